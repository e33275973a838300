"""The scheduler-node adapter counts the same compute FLOPs after Inductor's own overlap scheduling and bucketing
as in a compile without them.

The OverlapScheduler pins kernels' order by wrapping them in the ``control_deps`` higher-order op; the wrapper
becomes the origin of the kernel's buffer, so an adapter reading only the origin op sees no matmul there.  The
reference is an independent compile of the same model with no comm passes.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_passes.dag import NodeKind
from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
from fsdp_passes.testing import build_llama, capture_scheduler_nodes, example_inputs


def _collective_ms(node: torch.fx.Node, override_size: object = None) -> float | None:
    """A fixed price per collective, so the OverlapScheduler has something to hide; compute left to it."""
    if node.op == "call_function" and "_c10d_functional" in str(node.target) and "wait" not in str(node.target):
        return 0.05
    return None


def _compute_flops(fn, *args) -> tuple[dict[str, float], int]:
    """Per graph, the compute FLOPs the adapter sees in the order Inductor would generate; and how many
    scheduler nodes hold a kernel under a ``control_deps`` wrapper."""
    from torch._inductor.fx_passes.control_dependencies import control_deps

    flops, wrapped = {}, 0
    for cap in capture_scheduler_nodes(fn, *args):
        with cap.graph_context():
            dag = dag_from_scheduler_nodes(cap.after)
        flops[cap.graph_name] = sum(n.flops for n in dag if n.kind is NodeKind.COMPUTE)
        for snode in cap.after:
            origin = getattr(getattr(snode, "node", None), "origin_node", None)
            wrapped += getattr(origin, "target", None) is control_deps
    return flops, wrapped


@pytest.mark.parametrize("bucket_mode", ["default", "custom_ops"])
def test_overlap_scheduler_compute_matches_the_unplanned_compile(fake_pg, fresh_inductor, monkeypatch, bucket_mode):
    import torch._inductor.config as inductor_config
    import torch.utils._runtime_estimation as runtime_estimation

    # CPU: the analytical compute estimate asks the device for its peaks; any constants do
    monkeypatch.setattr(runtime_estimation, "get_device_tflops", lambda dtype: 100.0)
    monkeypatch.setattr(runtime_estimation, "get_gpu_dram_gbps", lambda: 1000.0)
    model = build_llama(1, reshard_after_forward=True, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    inputs = example_inputs(model)

    reference, _ = _compute_flops(model, *inputs)
    overlap = {
        "aten_distributed_optimizations.enable_overlap_scheduling": True,
        "aten_distributed_optimizations.collective_bucketing": True,
        "aten_distributed_optimizations.bucket_mode": bucket_mode,
        "aten_distributed_optimizations.enable_fusion_regions": False,
        "aten_distributed_optimizations.compute_estimator": "analytical",
        "aten_distributed_optimizations.custom_runtime_estimation": _collective_ms,
    }
    with inductor_config.patch(overlap):
        planned, wrapped = _compute_flops(model, *inputs)

    assert wrapped > 0, "the OverlapScheduler wrapped no kernel: the test would not exercise the adapter"
    assert set(planned) == set(reference) == {"forward", "backward"}
    for graph, flops in reference.items():
        assert flops > 0
        assert planned[graph] == pytest.approx(flops, rel=0.02), graph
