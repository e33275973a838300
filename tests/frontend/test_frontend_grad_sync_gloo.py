"""Gradient accumulation without communication (``set_requires_gradient_sync`` / ``set_requires_all_reduce``) on
a real 2-rank gloo group, eager and compiled with ``fsdp_passes.enable()`` defaults.

Two accumulation cycles of 4 micro-batches each; the gradients after each cycle are compared with one backward
of the unsharded model over the concatenated global batch (both ranks' 4 micro-batches), and the process-group
collectives of every micro-batch are counted with the profiler (``c10d::`` events: what reached the process
group).  The second cycle shows that the accumulators are freed by the reducing backward (else it would add the
first cycle's gradients again) and, compiled, that no step compiles anything new.

The model reads one linear layer twice (its parameters have two gathers and two reductions per step: only one
may add the accumulated gradient) and has 7-row weights, padded on 2 ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fsdp_passes.testing import run_on_gloo

# the shared helpers live in tests/ (test modules are imported by path, not as a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import fresh_compile_state  # noqa: E402

MICRO_BATCHES = 4
ROWS = 3  # per rank and micro-batch
CYCLES = 2
#: (gradient sync, all-reduce) per micro-batch: fully_shard skips the sync on all but the last; hybrid shard
#: also reduce-scatters the third without all-reducing it
SCHEDULES = {"fully_shard": [(False, True), (False, True), (False, True), (True, True)],
             "hybrid_shard": [(False, True), (False, True), (True, False), (True, True)]}


def _model():
    import torch
    import torch.nn as nn

    class TwiceRead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp = nn.Linear(8, 7)
            self.out = nn.Linear(7, 8)

        def forward(self, x):
            return self.inp(torch.tanh(self.out(torch.relu(self.inp(x)))))

    return TwiceRead()


def _data():
    import torch

    g = torch.Generator().manual_seed(1)
    return (torch.randn(MICRO_BATCHES, 2, ROWS, 8, generator=g),
            torch.randn(MICRO_BATCHES, 2, ROWS, 7, generator=g))


def _loss(out, target):
    # the mean over a micro-batch, divided by the number of micro-batches: their sum is the global batch's mean
    return ((out - target) ** 2).mean() / MICRO_BATCHES


def _reference_grads() -> dict:
    """One backward of the unsharded model over the global batch (every rank's every micro-batch)."""
    x, y = _data()
    model = _model()
    (((model(x.reshape(-1, 8)) - y.reshape(-1, 7)) ** 2).mean()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _collectives(prof) -> dict:
    from collections import Counter

    names = Counter(e.name for e in prof.events())
    return {"reduce_scatter": sum(c for n, c in names.items() if n.startswith("c10d::reduce_scatter")),
            "all_reduce": sum(c for n, c in names.items() if n.startswith("c10d::allreduce")),
            "all_gather": sum(c for n, c in names.items() if n.startswith("c10d::allgather"))}


def _accumulate(rank: int, world_size: int, mode: str, compiled: bool) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_passes

    ref = _reference_grads()
    x, y = _data()
    if mode == "hybrid_shard":  # the replica dim over the 2 ranks: the all-reduce is what moves data
        model = fsdp_passes.data_parallel(_model(), init_device_mesh("cpu", (2, 1)), mode=mode)
    else:
        model = _model()
        fsdp_passes.data_parallel(model.out)  # a nested call: recurse=True reaches it from the root
        model = fsdp_passes.data_parallel(model, mode=mode)
    fresh_compile_state()
    graphs_before = counters["stats"]["unique_graphs"]
    if compiled:
        fsdp_passes.enable()
    fn = torch.compile(model, fullgraph=True) if compiled else model
    out: dict = {"collectives": [], "max_rel": [], "graphs": [], "freed": []}
    try:
        for _ in range(CYCLES):
            for k, (sync, all_reduce) in enumerate(SCHEDULES[mode]):
                model.set_requires_gradient_sync(sync)
                if mode == "hybrid_shard":
                    model.set_requires_all_reduce(all_reduce)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    _loss(fn(x[k, rank]), y[k, rank]).backward()
                out["collectives"].append(_collectives(prof))
            got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            out["max_rel"].append(max(((got[n] - g).norm() / g.norm()).item() for n, g in ref.items()))
            out["graphs"].append(counters["stats"]["unique_graphs"] - graphs_before)
            states = [s for m in model.modules() for s in getattr(m, "_fsdp_shards", {}).values()]
            out["freed"].append(all(s.unsharded_sink.grad is None and s.partial_sink.grad is None for s in states))
            model.zero_grad()
    finally:
        fsdp_passes.disable()
    return out


def _runs(rank: int, world_size: int) -> dict:
    return {(mode, compiled): _accumulate(rank, world_size, mode, compiled)
            for mode in SCHEDULES for compiled in (False, True)}


@pytest.fixture(scope="module")
def results() -> list:
    return run_on_gloo(2, _runs, timeout=900)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", list(SCHEDULES))
def test_accumulated_gradients_equal_the_global_batch_and_only_syncing_steps_communicate(results, mode, compiled):
    schedule = SCHEDULES[mode] * CYCLES
    for rank, res in enumerate(results):
        got = res[(mode, compiled)]
        assert all(err <= 1e-6 for err in got["max_rel"]), (rank, got["max_rel"])
        assert all(got["freed"]), (rank, got["freed"])  # the reducing backward freed the accumulators
        for step, ((sync, all_reduce), counts) in enumerate(zip(schedule, got["collectives"], strict=True)):
            assert counts["all_gather"] > 0, (rank, step, counts)  # the profiler sees this step's collectives
            assert (counts["reduce_scatter"] > 0) == sync, (rank, step, counts)
            if mode == "hybrid_shard":
                assert (counts["all_reduce"] > 0) == (sync and all_reduce), (rank, step, counts)
            else:
                assert counts["all_reduce"] == 0, (rank, step, counts)
        if compiled:
            # one graph per setting (fully_shard: unsynced, synced; hybrid: also reduce-scatter only), all of
            # them compiled in the first cycle: the second compiles nothing
            first, second = got["graphs"]
            assert first == len(set(SCHEDULES[mode])) and second == first, (rank, got["graphs"])
