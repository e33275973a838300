"""Inductor's lowering of a merged all-gather's copy-out (``bucketing.rewrite.copy_out_members``).

Left to Inductor's implicit fallback, the op becomes a fallback kernel whose result a separate node then
allocates: Inductor's memory estimate (and so the scheduler-level DAG) frees the gathered buffer before the
copy exists, a bucket too little at that step.  Lowered here it is an extern kernel writing into a buffer
Inductor allocates at that kernel (``copy_out_members_into(..., out=buf)``), like a matmul: the gathered
buffer and its copy are alive together, as they are when it runs, and on both sides of the estimate.
"""

from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor.lowering import lowerings, register_lowering

from ..bucketing import rewrite  # noqa: F401  (defines the ops)

_OP = torch.ops.fsdp_passes.copy_out_members.default
_INTO = torch.ops.fsdp_passes.copy_out_members_into.default


def _lower(gathered: ir.TensorBox, numels: list[int]) -> ir.TensorBox:
    gathered = ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(gathered))
    layout = ir.FixedLayout(gathered.get_device(), gathered.get_dtype(), list(gathered.get_size()))
    node = ir.ExternKernelOut(layout=layout, inputs=[gathered], constant_args=[list(numels)],
                              python_kernel_name="torch.ops.fsdp_passes.copy_out_members_into.default",
                              op_overload=_INTO)
    return ir.TensorBox.create(node)


def register() -> None:
    """Register the lowering (once per process)."""
    if _OP not in lowerings:
        register_lowering(_OP, type_promotion_kind=None)(_lower)
