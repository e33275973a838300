"""A kernel reading its weight's slice of a merged gather bucket is charged the slice, as in a compile where the
weight is gathered alone.

Inductor's byte count charges each access the whole loop's size capped at the buffer, so a norm over
(tokens, dim) reading a dim-sized weight out of a bucket holding a whole layer would be charged the whole
bucket.  The reference is the same model compiled without merging.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_passes.dag import NodeKind
from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
from fsdp_passes.testing import build_llama, capture_scheduler_nodes, example_inputs


def _norm_read_bytes(model, inputs, **options) -> list[int]:
    """Bytes read by the forward graph's RMSNorm kernels (the kernels computing a mean), in order."""
    captures = capture_scheduler_nodes(model, *inputs, options=dict(reorder=False, **options))
    forward = next(c for c in captures if c.graph_name == "forward")
    with forward.graph_context():
        dag = dag_from_scheduler_nodes(forward.after)
    return [n.in_bytes for n in dag if n.kind is NodeKind.COMPUTE and "mean" in (n.op or "")]


def test_norm_reading_a_merged_bucket_is_charged_its_slice(fake_pg, fresh_inductor):
    model = build_llama(1, dim=256, ffn_dim=512, seq_len=64, reshard_after_forward=True,
                        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    inputs = example_inputs(model)
    alone = _norm_read_bytes(model, inputs, bucketing="none")
    merged = _norm_read_bytes(model, inputs, bucketing="manual", bucket_plan=["layers.0"])
    # the layer's bucket: 2 norms' and 7 matrices' weights, about 20x a norm's whole input
    assert len(alone) == len(merged) == 3
    assert merged == pytest.approx(alone, rel=0.01)
