"""The reordering leaves Inductor's generated C++ kernels as they are: transformers GPT-2 (4 blocks) sharded by
torchtitan's SimpleFSDP, compiled on a fake 8-rank group with ``enable()`` defaults.

On the CPU, Inductor writes each run of consecutive compute nodes (no extern kernel, collective or wait
between them) as one C++ function; a collective issued or waited on inside a run splits it into new
kernels, each compiled again.  Read off Inductor's own node order (before the passes), every run is still
contiguous in the order the passes return; with the step that mends split runs switched off, the same
compile splits one, so the check can fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

import fsdp_passes
from fsdp_passes.reordering import plan as plan_module
from fsdp_passes.testing import capture_scheduler_nodes, fake_process_group

sys.path.insert(0, str(Path(__file__).resolve().parent))
from third_party_models import sharded_loss_module, token_ids  # noqa: E402


def _runs(nodes) -> list[list[str]]:
    """Inductor's C++ kernels in a node order: runs of two or more consecutive nodes that generate code and
    are not extern kernels or templates (Scheduler.codegen's flush rule); nodes generating no code (a
    concatenation's NopKernel) neither end a run nor join it."""
    runs, current = [], []
    for node in nodes:
        if type(node).__name__ == "NopKernelSchedulerNode":
            continue
        if node.is_extern() or node.is_template():
            runs.append(current)
            current = []
        else:
            current.append(node.get_name())
    runs.append(current)
    return [r for r in runs if len(r) > 1]


def _split_runs() -> list[list[str]]:
    with fake_process_group(world_size=8, rank=0):
        model = sharded_loss_module("gpt2", 8, n_layers=4)
        fsdp_passes.enable()
        try:
            captures = capture_scheduler_nodes(model, token_ids("gpt2"))
        finally:
            fsdp_passes.disable()
    split = []
    for cap in captures:
        after = [n.get_name() for n in cap.after if type(n).__name__ != "NopKernelSchedulerNode"]
        pos = {name: p for p, name in enumerate(after)}
        split += [run for run in _runs(cap.before) if max(map(pos.get, run)) - min(map(pos.get, run)) + 1 != len(run)]
    return split


def test_reordering_splits_none_of_inductors_cpu_kernels(monkeypatch):
    assert _split_runs() == []
    monkeypatch.setattr(plan_module, "keep_kernel_groups_whole", lambda dag, order, fits=None: (list(order), 0))
    assert len(_split_runs()) >= 1
