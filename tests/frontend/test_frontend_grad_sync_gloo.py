"""Gradient accumulation without communication (``set_requires_gradient_sync`` / ``set_requires_all_reduce``) on
a real 2-rank gloo group, eager and compiled with ``fsdp_passes.enable()`` defaults.

Two accumulation cycles of 4 micro-batches each; the gradients after each cycle are compared with one backward
of the unsharded model over the concatenated global batch (both ranks' 4 micro-batches), and the process-group
collectives of every micro-batch are counted with the profiler (``c10d::`` events: what reached the process
group).  The second cycle shows that the accumulators are freed by the reducing backward (else it would add the
first cycle's gradients again) and, compiled, that no step compiles anything new.

The model reads one linear layer twice (its parameters have two gathers and two reductions per step: only one
may add the accumulated gradient) and has 7-row weights, padded on 2 ranks.

A module conversion in the middle of an accumulation, while accumulators wait, must keep what was accumulated:
the second cycle calls ``model.to(torch.float32)`` (a no-op) in its middle, eager and compiled (it must compile
nothing either); one more eager cycle per conversion (``.to(dtype)``, ``.float()``, ``.double()`` and back,
``.cpu()``, ``to_empty``, ``load_state_dict``) is compared with the same global-batch reference.
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
        for cycle in range(CYCLES):
            for k, (sync, all_reduce) in enumerate(SCHEDULES[mode]):
                model.set_requires_gradient_sync(sync)
                if mode == "hybrid_shard":
                    model.set_requires_all_reduce(all_reduce)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    _loss(fn(x[k, rank]), y[k, rank]).backward()
                out["collectives"].append(_collectives(prof))
                if cycle == 1 and k == CONVERT_AFTER[mode]:
                    _to_float32(model)  # a no-op conversion: keeps the accumulators, compiles nothing
            got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            out["max_rel"].append(max(((got[n] - g).norm() / g.norm()).item() for n, g in ref.items()))
            out["graphs"].append(counters["stats"]["unique_graphs"] - graphs_before)
            states = [s for m in model.modules() for s in getattr(m, "_fsdp_shards", {}).values()]
            out["freed"].append(all(s.unsharded_sink.grad is None and s.partial_sink.grad is None for s in states))
            model.zero_grad()
    finally:
        fsdp_passes.disable()
    return out


def _to_float32(model) -> None:
    import torch

    model.to(torch.float32)


def _restore_after_to_empty(model) -> None:
    import torch

    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to_empty(device="cpu")
    with torch.no_grad():  # in place into the (uninitialised) shards, as one re-initialises after to_empty
        for n, p in model.named_parameters():
            p.copy_(values[n])


#: conversions in the middle of an accumulation cycle; each must keep the accumulated gradients.  double(): the
#: parameters stay float64 (the micro-batches after it run in float64)
CONVERSIONS = {
    "to_float32_noop": _to_float32,
    "float_noop": lambda m: m.float(),
    "double": lambda m: m.double(),
    "double_then_float": lambda m: m.double().float(),
    "cpu_noop": lambda m: m.cpu(),
    "to_empty_then_restore": _restore_after_to_empty,
    "load_state_dict": lambda m: m.load_state_dict({k: v.detach().clone() for k, v in m.state_dict().items()}),
}
#: where the conversion falls: after micro-batch 2 (0-based 1) of fully_shard's schedule (unsharded accumulators
#: waiting); after micro-batch 3 of hybrid shard's (a reduce-scattered, not all-reduced, accumulator waiting)
CONVERT_AFTER = {"fully_shard": 1, "hybrid_shard": 2}


def _accumulate_with_conversion(rank: int, mode: str, conversion: str) -> float:
    """The largest relative error, over the parameters, of the gradient after one eager accumulation cycle with
    ``conversion`` in its middle, against the unsharded model's over the global batch."""
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_passes

    ref = _reference_grads()
    x, y = _data()
    mesh = init_device_mesh("cpu", (2, 1)) if mode == "hybrid_shard" else None
    model = fsdp_passes.data_parallel(_model(), mesh, mode=mode)
    for k, (sync, all_reduce) in enumerate(SCHEDULES[mode]):
        model.set_requires_gradient_sync(sync)
        model.set_requires_all_reduce(all_reduce)
        dtype = model.inp._parameters["weight"].dtype  # float64 after double()
        _loss(model(x[k, rank].to(dtype)), y[k, rank].to(dtype)).backward()
        if k == CONVERT_AFTER[mode]:
            CONVERSIONS[conversion](model)
    got = {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}
    return max(((got[n] - g.double()).norm() / g.double().norm()).item() for n, g in ref.items())


def _runs(rank: int, world_size: int) -> dict:
    out: dict = {(mode, compiled): _accumulate(rank, world_size, mode, compiled)
                 for mode in SCHEDULES for compiled in (False, True)}
    for mode in SCHEDULES:
        for conversion in CONVERSIONS:
            out[("convert", mode, conversion)] = _accumulate_with_conversion(rank, mode, conversion)
    return out


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


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
@pytest.mark.parametrize("mode", list(SCHEDULES))
def test_a_conversion_in_the_middle_of_an_accumulation_keeps_the_accumulated_gradients(results, mode, conversion):
    for rank, res in enumerate(results):
        # the same bound as without a conversion; a dropped accumulator is off by the order of the gradient
        err = res[("convert", mode, conversion)]
        assert err <= 1e-6, (rank, err)
