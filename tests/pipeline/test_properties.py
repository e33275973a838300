"""Property tests: random FSDP-shaped DAGs through the bucketing planners and the reordering policy, random
option sets through ``enable()``.

About 1,200 random DAGs per run (``max_examples`` split across the tests below), well under a minute.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsdp_passes
from fsdp_passes.pipeline import plan_bucketing
from fsdp_passes.bucketing.plan import bucket_key, plan_cycles
from fsdp_passes.cost_model import CostModel
from fsdp_passes.dag import CollectiveOp, Dag, DagNode, NodeKind
from fsdp_passes.options import Options
from fsdp_passes.reordering import plan_order

C, K, W = NodeKind.COMPUTE, NodeKind.COLLECTIVE, NodeKind.WAIT
AG, RS, AR = CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE
COST = CostModel.from_options("h100-nvlink")
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def fsdp_dags(draw) -> Dag:
    """Forward blocks (gather params on the shard group, wait, compute chain, maybe a TP all-reduce), then
    backward blocks in reverse (re-gather, compute, gradient reduce-scatter, maybe an HSDP all-reduce)."""
    n_layers = draw(st.integers(1, 5))
    shard = draw(st.sampled_from(["0", "1"]))
    tp, replicate = "tp", "rep"
    use_tp, use_hsdp = draw(st.booleans()), draw(st.booleans())
    nodes: list[DagNode] = []
    edges: list[tuple[int, int]] = []

    def add(node: DagNode, preds=()) -> int:
        nodes.append(node)
        i = len(nodes) - 1
        edges.extend((p, i) for p in preds)
        return i

    def coll(op, group, size, nbytes, dtype, fsdp, layer, preds=()):
        c = add(DagNode(f"c{len(nodes)}", K, collective=op, group_name=group, group_size=size, comm_bytes=nbytes,
                        out_bytes=nbytes, dtype=dtype, fsdp=fsdp, module_fqn=f"layers.{layer}",
                        reduce_op=None if op is AG else "sum"), preds)
        w = add(DagNode(f"w{len(nodes)}", W, alias_of=c, collective_of=c, group_name=group), [c])
        return c, w

    x = add(DagNode("x", C, out_bytes=draw(st.integers(1, 4096))))
    saved = []
    for layer in range(n_layers):
        params = []
        for _ in range(draw(st.integers(1, 3))):
            dtype = draw(st.sampled_from(["bfloat16", "float32"]))
            _, w = coll(AG, shard, 8, draw(st.integers(64, 1 << 22)), dtype, True, layer)
            params.append(w)
        for p in params:
            x = add(DagNode(f"mm{len(nodes)}", C, out_bytes=draw(st.integers(1, 1 << 20)),
                            flops=draw(st.floats(0, 1e9))), [x, p])
            saved.append(x)
        if use_tp:
            _, x = coll(AR, tp, 2, draw(st.integers(64, 1 << 16)), "float32", False, layer, [x])
    g = add(DagNode("loss", C, out_bytes=4), [x])
    for layer in reversed(range(n_layers)):
        for _ in range(draw(st.integers(1, 3))):
            dtype = draw(st.sampled_from(["bfloat16", "float32"]))
            _, w = coll(AG, shard, 8, draw(st.integers(64, 1 << 22)), dtype, True, layer)
            act = draw(st.sampled_from(saved))
            g = add(DagNode(f"dmm{len(nodes)}", C, out_bytes=draw(st.integers(1, 1 << 20)),
                            flops=draw(st.floats(0, 1e9))), [g, w, act])
            grad = add(DagNode(f"dw{len(nodes)}", C, out_bytes=draw(st.integers(64, 1 << 20))), [g])
            _, rw = coll(RS, shard, 8, draw(st.integers(64, 1 << 22)), "float32", True, layer, [grad])
            nodes[rw].is_output = True
            if use_hsdp:
                _, aw = coll(AR, replicate, 2, draw(st.integers(64, 1 << 20)), "float32", True, layer, [rw])
                nodes[aw].is_output = True
        if use_tp and draw(st.booleans()):
            _, g = coll(AR, tp, 2, draw(st.integers(64, 1 << 16)), "float32", False, layer, [g])
    return Dag(nodes, edges)


def _check_plan(dag: Dag, plan, options: Options, budget) -> None:
    collectives = set(dag.collectives())
    members = [m for b in plan.buckets for m in b.members]
    assert len(members) == len(set(members)), "a collective is in two buckets"
    assert set(members) <= collectives
    # nothing lost: every collective is in a bucket or has a reason to stay alone
    assert set(members) | set(plan.unbucketed) == collectives
    assert plan.n_collectives_before == len(collectives)
    for b in plan.buckets:
        keys = {bucket_key(dag.nodes[m]) for m in b.members}
        assert len(keys) == 1  # one op, process group, reduce op, dtype, group size
        assert b.group_name == dag.nodes[b.members[0]].group_name
        if len(b) > 1:
            assert all(dag.nodes[m].fsdp or options.bucket_non_fsdp for m in b.members)
            # no member depends on another (ids are a topological order)
            for a in b.members:
                for c in b.members:
                    assert a == c or not dag.reaches(a, c)
            if options.bucket_cap_mb is not None:
                assert b.comm_bytes <= options.bucket_cap_mb * 2**20
            if budget is not None:
                assert b.extra_bytes <= (budget(b.op) if callable(budget) else budget)
    assert plan_cycles(dag, plan.buckets) == []


@settings(max_examples=400, **SETTINGS)
@given(dag=fsdp_dags(), budget=st.sampled_from([0, "5%", "1GB", 1 << 20]),
       cap=st.sampled_from([None, 1, 8, 64]), non_fsdp=st.booleans())
def test_auto_planner_properties(dag, budget, cap, non_fsdp):
    options = Options(bucketing="auto", memory_budget=budget, bucket_cap_mb=cap, bucket_non_fsdp=non_fsdp)
    from fsdp_passes.pipeline.budget import graph_memory_budget

    budget_bytes = graph_memory_budget(dag, options).limit
    plan = plan_bucketing(dag, options, COST)
    _check_plan(dag, plan, options, budget_bytes)


@settings(max_examples=300, **SETTINGS)
@given(dag=fsdp_dags(), per_layer=st.booleans(), non_fsdp=st.booleans())
def test_manual_planner_properties(dag, per_layer, non_fsdp):
    plan_entries = ["layers.[0-4]"] if per_layer else [["layers.*"]]
    options = Options(bucketing="manual", bucket_plan=plan_entries, bucket_non_fsdp=non_fsdp)
    plan = plan_bucketing(dag, options, COST)
    _check_plan(dag, plan, options, None)
    # buckets never cross process groups even when one plan entry covers several
    for b in plan.buckets:
        assert len({dag.nodes[m].group_name for m in b.members}) == 1


@settings(max_examples=500, **SETTINGS)
@given(dag=fsdp_dags(), budget=st.sampled_from([0, 1 << 16, 1 << 24, 1 << 40]),
       max_prefetch=st.sampled_from([None, 1, 2]), data=st.data())
def test_plan_order_properties(dag, budget, max_prefetch, data):
    durations = COST.estimate(dag)
    if data.draw(st.booleans()):  # sometimes arbitrary durations
        durations = [data.draw(st.floats(0, 5, allow_nan=False)) for _ in dag.nodes]
    result = plan_order(dag, durations, memory_budget_bytes=budget, max_prefetch=max_prefetch)
    order = result.order
    assert sorted(order) == list(range(len(dag))), "node lost or duplicated"
    assert dag.order_violations(order) == []  # dependencies and per-group order
    pos = {i: p for p, i in enumerate(order)}
    for seq in dag.group_sequences().values():
        assert [pos[i] for i in seq] == sorted(pos[i] for i in seq)
    assert result.after.peak_bytes <= result.memory_limit or result.fallback
    assert result.memory_limit == result.baseline_peak + budget
    assert result.after.peak_bytes <= result.baseline_peak + budget
    assert result.after.exposed_ms <= result.before.exposed_ms + 1e-9
    assert result.after.makespan_ms <= result.before.makespan_ms + 1e-9
    # collectives that are not FSDP-like are never issued later relative to compute
    before, after, count_b, count_a = {}, {}, 0, 0
    for i in range(len(dag)):
        before[i] = count_b
        count_b += dag.nodes[i].kind is C
    for i in order:
        after[i] = count_a
        count_a += dag.nodes[i].kind is C
    for i in dag.collectives():
        if not dag.nodes[i].fsdp:
            assert after[i] <= before[i]


# -- options ------------------------------------------------------------------------------------------------------

_VALID = {
    "bucketing": st.sampled_from(["auto", "none"]),
    "bucket_cap_mb": st.sampled_from([None, 1, 25.5]),
    "bucket_non_fsdp": st.booleans(),
    "reorder": st.booleans(),
    "cluster": st.sampled_from(["h100-nvlink", "a100", "h200", "cpu-gloo", {"base": "h100-nvlink"}]),
    "memory_budget": st.sampled_from([0, 1 << 20, "5%", "512MB", "2GiB", "0%"]),
    "max_prefetch": st.sampled_from([None, 1, 3]),
    "strict": st.booleans(),
}
_INVALID = {
    "bucketing": st.sampled_from(["fast", "", None, 3, "AUTO"]),
    "bucket_plan": st.sampled_from(["layers", [], [""], [[]], [3]]),
    "bucket_cap_mb": st.sampled_from([0, -1, "big", True]),
    "bucket_non_fsdp": st.sampled_from(["yes", 1, None]),
    "reorder": st.sampled_from(["true", 0, None]),
    "cluster": st.sampled_from(["tpu", None, 5, {"base": "nope"}]),
    "calibration": st.sampled_from(["/nonexistent/calibration.json", 5]),
    "memory_budget": st.sampled_from(["abc", -1, "-5%", True, "12 parsecs"]),
    "max_prefetch": st.sampled_from([0, -2, 1.5, "2", True]),
    "debug_dir": st.sampled_from([5, 1.5, ["dir"]]),
    "strict": st.sampled_from(["no", 2, None]),
}


@settings(max_examples=120, **SETTINGS)
@given(data=st.data())
def test_random_options_through_enable(data):
    names = data.draw(st.lists(st.sampled_from(sorted(_VALID)), unique=True, max_size=len(_VALID)))
    kwargs = {n: data.draw(_VALID[n]) for n in names}
    bad = data.draw(st.none() | st.sampled_from(sorted(_INVALID)))
    if bad is not None:
        kwargs[bad] = data.draw(_INVALID[bad])
    try:
        options = fsdp_passes.enable(**kwargs)
    except ValueError as exc:
        assert bad is not None, f"valid options rejected: {kwargs}: {exc}"
        assert bad in str(exc), f"error does not name {bad}: {exc}"
    else:
        assert bad is None, f"invalid {bad}={kwargs[bad]!r} accepted"
        assert fsdp_passes.is_enabled()
        for k, v in kwargs.items():
            assert getattr(options, k) == v
    finally:
        fsdp_passes.disable()
    assert not fsdp_passes.is_enabled()


@pytest.mark.parametrize("kwargs", [dict(bucket_plan=["layers"]), dict(bucketing="manual")])
def test_manual_plan_consistency_is_checked(kwargs):
    with pytest.raises(ValueError, match="bucket"):
        Options(**kwargs)


@pytest.mark.parametrize("value", [1.5, None, [1], float("nan"), "nan%"])
def test_malformed_memory_budget_names_the_option(value):
    with pytest.raises(ValueError, match="memory_budget"):
        Options(memory_budget=value)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_bucket_cap_rejected(value):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        Options(bucket_cap_mb=value)
