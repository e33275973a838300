"""Inductor's lowerings of a bucket's copies: a gather bucket's copy-in and copy-out
(``bucketing.rewrite.copy_in_members`` / ``copy_out_members``) and a reduction bucket's ``bucket_cat``.

Left to Inductor's implicit fallback, such an op becomes a fallback kernel whose result a separate node then
allocates: Inductor's memory estimate (and so the scheduler-level DAG) frees the op's inputs before its
result exists, a bucket too little at that step.  Lowered here each is an extern kernel writing into a
buffer Inductor allocates at that kernel (``..._into(..., out=buf)``), like a matmul: inputs and result are
alive together, as they are when it runs, and on both sides of the estimate.

``bucket_cat`` is Inductor's own concatenation (``ConcatKernel``: a buffer allocated by a node that runs no
kernel, each input written into its slice where that input is placed) except for how an input that is
already a buffer gets there: Inductor generates a copy kernel for it, here it is an extern kernel
(``copy_into_slot``) writing into the slice.  Inputs still to be computed are computed into their slice, as
Inductor does.
"""

from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor.lowering import lowerings, register_lowering

from ..bucketing import rewrite  # noqa: F401  (defines the ops)

_COPY_OUT = torch.ops.fsdp_passes.copy_out_members.default
_COPY_IN = torch.ops.fsdp_passes.copy_in_members.default
_BUCKET_CAT = torch.ops.fsdp_passes.bucket_cat.default


def _lower_copy_out(gathered: ir.TensorBox, numels: list[int]) -> ir.TensorBox:
    gathered = ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(gathered))
    layout = ir.FixedLayout(gathered.get_device(), gathered.get_dtype(), list(gathered.get_size()))
    node = ir.ExternKernelOut(layout=layout, inputs=[gathered], constant_args=[list(numels)],
                              python_kernel_name="torch.ops.fsdp_passes.copy_out_members_into.default",
                              op_overload=torch.ops.fsdp_passes.copy_out_members_into.default)
    return ir.TensorBox.create(node)


class _CopyInKernel(ir.ExternKernelOut):
    """``copy_in_members_into([m_0, m_1, ...], out=buf)``: the members are the kernel's inputs (read,
    kept alive until it runs) but one list argument of the op."""

    def codegen_args(self) -> list[str]:
        members = ", ".join(x.codegen_reference() for x in self.inputs)
        return [f"[{members}]", *self.codegen_const_args()]


def _lower_copy_in(members: list[ir.TensorBox]) -> ir.TensorBox:
    realized = [ir.ExternKernel.realize_input(m) for m in members]
    numel = sum((m.get_numel() for m in realized[1:]), realized[0].get_numel())
    layout = ir.FixedLayout(realized[0].get_device(), realized[0].get_dtype(), [numel])
    node = _CopyInKernel(layout=layout, inputs=realized,
                         python_kernel_name="torch.ops.fsdp_passes.copy_in_members_into.default",
                         op_overload=torch.ops.fsdp_passes.copy_in_members_into.default)
    return ir.TensorBox.create(node)


def _is_buffer(x: ir.IRNode) -> bool:
    """Whether ``x`` (through views) reads a buffer that exists already: a kernel's result, a graph input."""
    while isinstance(x, (ir.TensorBox, ir.BaseView)):
        x = x.data
    return isinstance(x, ir.StorageBox) and ir.IRNode.is_realized_node(x.data)


class _BucketConcat(ir.ConcatKernel):
    """``ConcatKernel.create`` with its inputs' copies of buffers made extern kernels."""

    @classmethod
    def realize_into(cls, src: ir.IRNode, dst: ir.IRNode) -> ir.IRNode:
        if isinstance(src, ir.TensorBox):
            src = src.data
        if not isinstance(dst, ir.ReinterpretView):
            storage, layout = ir.as_storage_and_layout(dst)
            dst = ir.ReinterpretView(data=storage, layout=layout)
        if isinstance(src, ir.StorageBox):
            src.realize()
            if cls.can_realize_into_without_copy(src, dst):
                return super().realize_into(src, dst)  # computed straight into the slice
        elif not _is_buffer(src):
            return super().realize_into(src, dst)  # a view of a computation: computed into the slice
        return ir.ExternKernelOut(layout=ir.NonOwningLayout(dst), inputs=[ir.ExternKernel.realize_input(src)],
                                  python_kernel_name="torch.ops.fsdp_passes.copy_into_slot.default",
                                  op_overload=torch.ops.fsdp_passes.copy_into_slot.default)


def _lower_bucket_cat(tensors: list[ir.TensorBox], dim: int) -> ir.TensorBox:
    return ir.TensorBox(_BucketConcat.create(tensors, dim))


def register() -> None:
    """Register the lowerings (once per process)."""
    if _COPY_OUT not in lowerings:
        register_lowering(_COPY_OUT, type_promotion_kind=None)(_lower_copy_out)
    if _COPY_IN not in lowerings:
        register_lowering(_COPY_IN, type_promotion_kind=None)(_lower_copy_in)
    if _BUCKET_CAT not in lowerings:
        register_lowering(_BUCKET_CAT, type_promotion_kind=None)(_lower_bucket_cat)
