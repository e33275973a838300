"""The installed passes inside a real torch.compile: cache keys, fallback on failure, strict mode."""

import uuid
import warnings

import pytest
import torch
import torch._dynamo
import torch._inductor.config as ic

import fsdp_passes
from fsdp_passes.inductor.failure_injection import inject_failure
from fsdp_passes.inductor.guard import FsdpPassError
from fsdp_passes.testing import build_mlp, example_inputs


@pytest.fixture(autouse=True)
def _clean():
    fsdp_passes.disable()
    fsdp_passes.last_reports(clear=True)
    torch._dynamo.reset()
    yield
    fsdp_passes.disable()
    torch._dynamo.reset()


def _plain_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _scheduler_reports():
    return [r for r in fsdp_passes.last_reports() if r.pass_name == "scheduler"]


def test_cache_never_serves_a_graph_compiled_with_other_options(fake_pg):
    """Compile, change an option, compile again in a fresh Dynamo state with the cache on: the pass runs
    again with the new options.  The same options again: served from the cache (the key is stable)."""
    model = build_mlp(n_layers=1, dim=16, reshard_after_forward=False)
    (x,) = example_inputs(model)
    budget_a, budget_b = (uuid.uuid4().int % 10**9 + 1 for _ in range(2))  # unique: no earlier cache entry
    with ic.patch(fx_graph_cache=True), torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad():
        fsdp_passes.enable(bucketing="none", memory_budget=budget_a)
        torch.compile(model)(x)
        assert [r.options["memory_budget"] for r in _scheduler_reports()] == [budget_a]

        torch._dynamo.reset()
        fsdp_passes.enable(bucketing="none", memory_budget=budget_b)
        torch.compile(model)(x)
        assert [r.options["memory_budget"] for r in _scheduler_reports()] == [budget_a, budget_b]

        torch._dynamo.reset()
        fsdp_passes.enable(bucketing="none", memory_budget=budget_a)
        torch.compile(model)(x)
        assert len(_scheduler_reports()) == 2  # a cache hit: the pass did not need to run


@pytest.mark.parametrize("mode", ["exception", "bad_order"])
def test_scheduler_pass_failure_warns_and_keeps_the_order(mode, fresh_inductor):
    model = _plain_model()
    x = torch.randn(4, 16)
    expected = model(x)
    fsdp_passes.enable(bucketing="none")
    with inject_failure("scheduler", mode), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model)(x)
    messages = [str(w.message) for w in caught if "fsdp_passes" in str(w.message)]
    assert messages and "scheduler pass failed" in messages[0]
    if mode == "bad_order":
        assert "proposed order rejected" in messages[0]
    torch.testing.assert_close(out, expected)


def test_fx_pass_failure_restores_the_graph(fresh_inductor):
    model = _plain_model()
    x = torch.randn(4, 16)
    expected = model(x)
    fsdp_passes.enable(bucketing="auto")
    with inject_failure("fx"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model)(x)
    assert any("fx pass failed" in str(w.message) for w in caught)
    torch.testing.assert_close(out, expected)
    assert any(r.pass_name == "fx" and r.fallback for r in fsdp_passes.last_reports())


@pytest.mark.parametrize("which", ["fx", "scheduler"])
def test_strict_raises(which, fresh_inductor):
    model = _plain_model()
    x = torch.randn(4, 16)
    fsdp_passes.enable(bucketing="auto", strict=True)
    with inject_failure(which), pytest.raises(Exception) as err:
        torch.compile(model)(x)
    chain, exc = [], err.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or getattr(exc, "inner_exception", None)
    assert any(isinstance(e, FsdpPassError) for e in chain), [type(e) for e in chain]


def test_one_memory_budget_for_both_passes(fake_pg):
    """What bucketing and gather placement may add to the peak (their claim) is taken off the budget
    reordering gets (the end-to-end promise is tested in test_memory_budget_end_to_end.py)."""
    from fsdp_passes.testing import capture_scheduler_nodes

    model = build_mlp(n_layers=4, dim=64, reshard_after_forward=True)
    options = {"bucketing": "manual", "bucket_plan": ["layers.[0-3]"], "memory_budget": "100%"}
    capture_scheduler_nodes(model, *example_inputs(model, batch=16), options=options)
    reports = fsdp_passes.last_reports()
    checked = 0
    for sched in (r for r in reports if r.pass_name == "scheduler"):
        fx = next(r for r in reports if r.pass_name == "fx" and r.graph == sched.graph)
        # the FX pass hands its budget and its plan's claim on it over, as its plan reported them
        assert sched.budget == fx.budget
        total, used = fx.budget.memory_budget_bytes, fx.budget.memory_budget_used_bytes
        assert (total, used) == (fx.extra["bucketing"]["memory_budget_bytes"],
                                 fx.extra["bucketing"]["memory_budget_used_bytes"])
        assert 0 <= used <= total and total > 0
        assert sched.extra["reorder_budget_bytes"] == max(0, total - used)
        assert sched.peak_memory_bytes_after - sched.peak_memory_bytes_before <= sched.extra["reorder_budget_bytes"]
        checked += used > 0
    assert checked >= 1  # the backward's placement / bucketing did use part of the budget
    # the scheduler pass found the FX pass's record of its own graph, forward and backward
    assert sorted(r.graph.split("_")[1] for r in reports if r.pass_name == "scheduler") == ["bwd", "fwd"]
