"""``benchmarks/gpu_check.py`` (``./dev.sh gpu-check``) on the CPU: its planning half (the demo model compiled
under a fake group with the passes in strict mode, its predictions collected), the predicted-vs-measured
comparison on a hand-made calibration, and the exit without CUDA."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(BENCH))


def _collectives(capture) -> int:
    return sum(1 for node in capture.graph_lowering.module.graph.nodes
               if node.op == "call_function" and any(op in str(node.target) for op in
                                                     ("all_gather_into_tensor", "reduce_scatter_tensor")))


def test_planning_half_compiles_strict_and_predicts_on_cpu(gpu_check, tmp_path):
    from fsdp_passes.testing import capture_scheduler_nodes, fake_process_group

    args = gpu_check.parse_args(["--layers", "2", "--dim", "64", "--seq-len", "32", "--batch", "2"])
    cfg = gpu_check.demo_config(args, "cpu-gloo")
    with fake_process_group(cfg.world_size):
        planned = gpu_check.plan(cfg, "cpu", tmp_path)
        planned.step()  # the compiled step runs again (what the measuring half times)
        model, inputs = gpu_check.build_model(cfg, "cpu")
        unplanned = capture_scheduler_nodes(lambda *x: gpu_check.loss_of(model, x), *inputs)
    s = planned.summary
    assert len(s["graphs"]) == 2 and s["fallbacks"] == {}
    # the plan bucketed: fewer collectives per graph than the same step compiled without the passes
    assert [c.graph_name for c in unplanned] == ["forward", "backward"]
    for n, c in zip(s["collectives_per_graph"].values(), unplanned):
        assert 0 < n < _collectives(c)
    # predictions the measuring half compares with the trace: every compute node priced, keyed by kernel
    assert s["compute_nodes"] > 10 and s["compute_nodes_with_kernel_key"] == s["compute_nodes"]
    assert s["predicted_compute_ms"] > 0
    assert s["predicted_makespan_ms"] >= s["predicted_compute_ms"] * 0.999


def test_predicted_against_measured_on_a_hand_made_calibration(gpu_check):
    from fsdp_passes.cost_model.calibration import Calibration

    cal = Calibration()
    cal.add_kernel("aten.mm float32[8,8];float32[8,8]", 4.0)
    cal.add_kernel("fused_relu", 0.5)
    nodes = [{"key": "aten.mm float32[8,8];float32[8,8]", "ms": 2.0}, {"key": "fused_relu", "ms": 1.0},
             {"key": "fused_other", "ms": 0.25}, {"key": None, "ms": 0.5}]
    out = gpu_check.compare_nodes(nodes, cal)
    assert (out["compute_nodes"], out["compute_nodes_measured"]) == (4, 2)
    assert out["predicted_over_measured"]["extern"]["median"] == 0.5
    assert out["predicted_over_measured"]["generated"]["median"] == 2.0
    assert (out["matched_predicted_ms"], out["matched_measured_ms"], out["predicted_compute_ms"]) == (3.0, 4.5, 3.75)
    assert out["unmatched_keys"] == ["None", "fused_other"]


def test_without_cuda_it_says_so_runs_nothing_and_exits_0(gpu_check, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    called = []
    monkeypatch.setattr(gpu_check, "plan", lambda *a, **k: called.append(a))
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out), "--work", str(tmp_path / "work")]) == 0
    assert "no CUDA" in capsys.readouterr().out
    assert not out.exists() and not (tmp_path / "work").exists() and not called


def test_numerics_stage_on_a_world_1_gloo_group(gpu_check):
    """The numerics stage as the GPU runs it (there on NCCL), here on gloo: compiled with the passes against eager."""
    args = gpu_check.parse_args(["--layers", "2", "--dim", "64", "--seq-len", "32", "--batch", "2", "--world-size", "1"])
    result = gpu_check.numerics(gpu_check.demo_config(args, "cpu-gloo"), "cpu", "gloo", steps=2)
    assert result["within_tolerance"], result
    eager, compiled = result["losses"]["eager"], result["losses"]["compiled"]
    assert len(eager) == len(compiled) == 2 and eager[1] < eager[0]  # the steps trained
    assert result["grad_max_rel_diff"] <= gpu_check.GRAD_RTOL
