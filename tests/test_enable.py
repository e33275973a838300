"""enable / disable / enabled: config round trip, chaining, option validation, environment overrides."""

import pickle

import pytest
import torch._inductor.config as ic

import fsdp_passes
from fsdp_passes import Options
from fsdp_passes.inductor.passes import FsdpGraphPass, FsdpSchedulerPass

SLOTS = ("post_grad_custom_post_pass", "reorder_for_compute_comm_overlap", "reorder_for_compute_comm_overlap_passes")


@pytest.fixture(autouse=True)
def _clean():
    fsdp_passes.disable()
    yield
    fsdp_passes.disable()


def snapshot():
    return {s: getattr(ic, s) for s in SLOTS}


def test_enable_installs_and_disable_restores_exactly():
    before = snapshot()
    opts = fsdp_passes.enable(bucketing="auto", reorder=True, cluster="h100-nvlink", memory_budget="5%")
    assert isinstance(opts, Options)
    assert isinstance(ic.post_grad_custom_post_pass, FsdpGraphPass)
    assert ic.reorder_for_compute_comm_overlap is True
    assert isinstance(ic.reorder_for_compute_comm_overlap_passes[-1], FsdpSchedulerPass)
    assert fsdp_passes.is_enabled()
    fsdp_passes.disable()
    assert snapshot() == before
    assert not fsdp_passes.is_enabled()


def test_enable_twice_replaces_options_without_stacking():
    fsdp_passes.enable(memory_budget="5%")
    fsdp_passes.enable(memory_budget=0, bucketing="none", check_ranks=False)
    ours = [p for p in ic.reorder_for_compute_comm_overlap_passes if isinstance(p, FsdpSchedulerPass)]
    assert len(ours) == 1 and ours[0].options.memory_budget == 0
    # bucketing="none" without check_ranks installs no FX pass at all
    assert not isinstance(ic.post_grad_custom_post_pass, FsdpGraphPass)
    # with check_ranks (the default) the FX pass is there to insert the check, and buckets nothing
    fsdp_passes.enable(memory_budget=0, bucketing="none")
    assert isinstance(ic.post_grad_custom_post_pass, FsdpGraphPass)


def test_chains_with_user_passes_and_restores_them():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    calls = []

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            calls.append(graph)

        def uuid(self):
            return "user-pass"

    def user_sched_pass(nodes):
        return nodes

    user = UserPass()
    old = snapshot()
    ic.post_grad_custom_post_pass = user
    ic.reorder_for_compute_comm_overlap = True
    ic.reorder_for_compute_comm_overlap_passes = [user_sched_pass]
    try:
        fsdp_passes.enable()
        ours = ic.post_grad_custom_post_pass
        assert ours.chained is user
        assert ic.reorder_for_compute_comm_overlap_passes[0] is user_sched_pass
        assert isinstance(ic.reorder_for_compute_comm_overlap_passes[1], FsdpSchedulerPass)
        # the user's pass still runs when ours does (on a graph with no collectives ours changes nothing)
        import torch.fx as fx

        g = fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(__import__("torch").ops.aten.relu.default, (x,)))
        ours(g)
        assert calls == [g]
        fsdp_passes.disable()
        assert ic.post_grad_custom_post_pass is user
        assert ic.reorder_for_compute_comm_overlap_passes == [user_sched_pass]
    finally:
        for k, v in old.items():
            setattr(ic, k, v)


def test_enabled_context_restores_previous_state():
    before = snapshot()
    with fsdp_passes.enabled(bucketing="none", reorder=False) as opts:
        assert opts.reorder is False
        assert fsdp_passes.is_enabled()
    assert snapshot() == before
    fsdp_passes.enable(memory_budget="1GB")
    with fsdp_passes.enabled(memory_budget=0):
        pass
    assert ic.reorder_for_compute_comm_overlap_passes[-1].options.memory_budget == "1GB"


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"bucketing": "sometimes"}, "bucketing"),
        ({"cluster": "tpu-pod"}, "cluster"),
        ({"memory_budget": "lots"}, "memory_budget"),
        ({"memory_budget": -1}, "memory_budget"),
        ({"max_prefetch": 0}, "max_prefetch"),
        ({"bucket_cap_mb": -5}, "bucket_cap_mb"),
        ({"bucketing": "manual"}, "bucket_plan"),
        ({"bucketing": "manual", "bucket_plan": ["layers.0", 3]}, "bucket_plan"),
        ({"reorder": "yes"}, "reorder"),
        ({"calibration": "/no/such/file.json"}, "calibration"),
        ({"strict": 1}, "strict"),
        ({"bucket_non_fsdp": None}, "bucket_non_fsdp"),
        ({"debug_dir": 3}, "debug_dir"),
        ({"cluster": {"base": "h100-nvlink", "gpus_per_node": -1}}, "cluster"),
    ],
)
def test_bad_options_raise_value_error_naming_the_option(kwargs, option):
    with pytest.raises(ValueError) as err:
        fsdp_passes.enable(**kwargs)
    assert option in str(err.value)
    assert not fsdp_passes.is_enabled()


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match="bucket_size"):
        fsdp_passes.enable(bucket_size=3)


def test_memory_budget_forms():
    assert Options(memory_budget="5%").memory_budget_bytes(1000, 7) == 50
    assert Options(memory_budget="2GiB").memory_budget_bytes(0, 7) == 2 * 2**30
    assert Options(memory_budget="512MB").memory_budget_bytes(0, 7) == 512 * 10**6
    assert Options(memory_budget=123).memory_budget_bytes(10**9, 7) == 123
    assert Options(memory_budget="2 blocks").memory_budget_bytes(10**9, 7) == 14
    assert Options(memory_budget="0.5 block").memory_budget_bytes(10**9, 10) == 5


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("FSDP_PASSES_BUCKETING", "none")
    monkeypatch.setenv("FSDP_PASSES_MEMORY_BUDGET", "2GB")
    monkeypatch.setenv("FSDP_PASSES_MAX_PREFETCH", "2")
    monkeypatch.setenv("FSDP_PASSES_REORDER", "false")
    monkeypatch.setenv("FSDP_PASSES_BUCKET_PLAN", '["layers.[0-1]"]')
    monkeypatch.delenv("FSDP_PASSES_BUCKET_PLAN")
    opts = fsdp_passes.enable(bucketing="auto")
    assert (opts.bucketing, opts.memory_budget, opts.max_prefetch, opts.reorder) == ("none", "2GB", 2, False)
    monkeypatch.setenv("FSDP_PASSES_MAX_PREFETCH", "many")
    with pytest.raises(ValueError, match="max_prefetch"):
        fsdp_passes.enable()


def test_uuid_changes_with_options_and_pickles_as_uuid():
    a = FsdpSchedulerPass(Options(memory_budget="5%"))
    b = FsdpSchedulerPass(Options(memory_budget="6%"))
    assert a.uuid() != b.uuid()
    assert a.uuid() == FsdpSchedulerPass(Options(memory_budget="5%")).uuid()
    assert pickle.dumps(a) != pickle.dumps(b)
    assert pickle.loads(pickle.dumps(a)).uuid() == a.uuid()
    fa = FsdpGraphPass(Options(bucketing="auto"))
    fb = FsdpGraphPass(Options(bucketing="auto", bucket_cap_mb=10))
    assert fa.uuid() != fb.uuid()


def test_uuid_changes_with_package_code(monkeypatch):
    from fsdp_passes.inductor import cache_key

    before = FsdpGraphPass(Options()).uuid()
    monkeypatch.setattr(cache_key, "package_fingerprint", lambda: "a different code version")
    assert FsdpGraphPass(Options()).uuid() != before
