"""Attention kernels are priced by their FLOPs, in their inputs' dtype, at the scheduler level as in the FX graph.

SDPA lowers to a fallback kernel with several results (on CPU ``_scaled_dot_product_flash_attention_for_cpu``,
on CUDA flash / efficient / cuDNN attention); without a FLOP count the roofline charges it one launch, which
on one H200 measured 10-20x below its time (benchmarks/gpu_compute.py).  The reference is the attention's
matmul count written out from the model's shapes.
"""

from __future__ import annotations

import torch

from fsdp_passes.dag import NodeKind
from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
from fsdp_passes.testing import build_llama, capture_scheduler_nodes, example_inputs


def test_attention_kernels_count_their_matmuls_in_their_dtype(fake_pg, fresh_inductor):
    batch, dim, heads, seq = 2, 64, 4, 16
    model = build_llama(1, dim, n_heads=heads, n_kv_heads=2, seq_len=seq, param_dtype=torch.bfloat16)
    # forward: Q K^T and P V, 2 FLOPs per multiply-add; backward: both recomputed-free products' gradients
    # (dQ, dK, dV, dP) and the recomputed scores: 5 matmuls
    forward = 2 * 2 * batch * heads * seq * seq * (dim // heads)
    expected = {"fwd": forward, "bwd": forward * 5 // 2}
    seen = {}
    for cap in capture_scheduler_nodes(model, *example_inputs(model, batch)):
        with cap.graph_context():
            dag = dag_from_scheduler_nodes(cap.after)
        attention = [n for n in dag if n.kind is NodeKind.COMPUTE and "scaled_dot_product" in str(n.kernel_key)
                     and str(n.kernel_key).startswith("aten.")]
        assert len(attention) == 1, (cap.graph_name, [n.kernel_key for n in attention])
        seen["bwd" if "backward" in str(attention[0].kernel_key) else "fwd"] = attention[0].flops
        # priced at the bf16 peak: the kernel owns no typed buffer (its results are MultiOutputs)
        assert attention[0].dtype == "bfloat16"
    assert seen == expected
