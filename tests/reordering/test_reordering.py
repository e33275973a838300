"""Reordering policy: prefetching gathers, sinking waits, memory budget, max_prefetch, safety net, scale."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_passes.dag import CollectiveOp, Dag, NodeKind
from fsdp_passes.reordering import HeadroomTree, ListScheduler, Structure, evaluate, plan_order
from fsdp_passes.reordering.headroom import EMPTY_MAX, RangeMaxTree
from fsdp_passes.simulate.memory import MemoryModel
from fsdp_passes.reordering import plan as plan_module
from fsdp_passes.reordering.scheduler import ScheduleOutcome
from fsdp_passes.simulate import exposed_and_makespan, memory_curve, simulate

from fsdp_passes.testing import DagBuilder

C, K, W = NodeKind.COMPUTE, NodeKind.COLLECTIVE, NodeKind.WAIT
AG, RS, AR = CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE


class Builder(DagBuilder):
    default_group = "dp"


def forward_dag(blocks=4, param=100, act=10, ag_ms=2.0, mm_ms=1.5, group="dp"):
    """Per block: AG -> wait -> two matmuls; activations are saved (graph outputs), as in a forward graph."""
    b = Builder()
    x = b.input("x")
    for i in range(blocks):
        a = b.coll(f"ag{i}", ag_ms, group=group, out=param)
        w = b.wait(f"ag{i}_wait", a)
        x = b.compute(f"mm{i}a", mm_ms, x, w, out=act, output=True)
        x = b.compute(f"mm{i}b", mm_ms, x, w, out=act, output=True)
    return b


def backward_dag(blocks=4, param=100, grad=100, act=10, ag_ms=2.0, rs_ms=2.0, mm_ms=1.5, group="dp"):
    """Reshard-after-forward backward: per block (last first) re-gather, grad-input and grad-weight matmuls,
    reduce-scatter of the weight gradient, its wait an output of the graph."""
    b = Builder()
    g = b.input("grad_out")
    saved = [b.input(f"saved{i}") for i in range(blocks)]
    for i in reversed(range(blocks)):
        a = b.coll(f"ag{i}", ag_ms, group=group, out=param)
        w = b.wait(f"ag{i}_wait", a)
        gw = b.compute(f"dw{i}", mm_ms, g, saved[i], out=grad)
        g = b.compute(f"dx{i}", mm_ms, g, w, out=act)
        r = b.coll(f"rs{i}", rs_ms, gw, op=RS, group=group, out=grad // 4)
        b.wait(f"rs{i}_wait", r, output=True)
    b.compute("loss_out", 0.5, g, out=act, output=True)
    return b


def names(dag, order):
    return [dag.nodes[i].name for i in order]


def pos_of(order):
    pos = [0] * len(order)
    for p, i in enumerate(order):
        pos[i] = p
    return pos


def check_plan(dag, durations, res, budget, max_prefetch=None):
    """Every hard guarantee of plan_order, checked with the simulator."""
    n = len(dag)
    assert not (res.fallback or "").startswith("scheduler error"), res.fallback
    assert sorted(res.order) == list(range(n))
    assert dag.order_violations(res.order) == []
    before = simulate(dag, list(range(n)), durations)
    after = simulate(dag, res.order, durations)
    assert after.peak_memory <= before.peak_memory + budget
    assert after.exposed_total <= before.exposed_total
    assert after.makespan <= before.makespan
    assert res.after.exposed_ms == after.exposed_total and res.after.peak_bytes == after.peak_memory
    assert res.before.exposed_ms == before.exposed_total
    for group, seq in dag.group_sequences().items():
        pos = pos_of(res.order)
        assert sorted(seq, key=pos.__getitem__) == seq, group
    if max_prefetch is not None and res.fallback is None:
        assert max_inflight_at_fsdp_issue(dag, res.order) <= max_prefetch
    return before, after


def max_inflight_at_fsdp_issue(dag, order):
    """Most collectives of a group in flight (issued, first wait not run) when an FSDP collective of it
    is issued, itself included."""
    waits: dict[int, list[int]] = {}
    for i, node in enumerate(dag.nodes):
        if node.kind is W and node.collective_of is not None:
            waits.setdefault(node.collective_of, []).append(i)
    inflight: dict[str, set[int]] = {}
    worst = 0
    for i in order:
        node = dag.nodes[i]
        if node.kind is K:
            g = node.group_name or "?"
            s = inflight.setdefault(g, set())
            if node.fsdp and node.collective is not CollectiveOp.OTHER:
                worst = max(worst, len(s) + 1)
            if i in waits:
                s.add(i)
        elif node.kind is W and node.collective_of is not None:
            c = node.collective_of
            inflight.get(dag.nodes[c].group_name or "?", set()).discard(c)
    return worst


# -- FSDP-shaped graphs -----------------------------------------------------------------------------------
def test_forward_gathers_next_block_during_current_block():
    b = forward_dag()
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=1000)
    before, after = check_plan(dag, b.durations, res, 1000)
    pos = pos_of(res.order)
    idx = dag.index
    for i in range(3):
        ag_next, wait_next = idx[f"ag{i + 1}"], idx[f"ag{i + 1}_wait"]
        first_mm = idx[f"mm{i}a"]
        assert pos[ag_next] < pos[first_mm], names(dag, res.order)
        assert pos[wait_next] > pos[first_mm], names(dag, res.order)
        assert res.issue_shift[ag_next] > 0
        assert "prefetched" in res.reasons[ag_next]
    assert after.exposed_total < before.exposed_total
    assert res.moved == 3 and res.fallback is None
    # only the first gather is exposed: nothing runs before it
    assert after.exposed_total == pytest.approx(2.0)
    assert after.makespan == pytest.approx(14.0)
    print(f"forward: exposed {before.exposed_total} -> {after.exposed_total} ms, "
          f"makespan {before.makespan} -> {after.makespan} ms, peak {before.peak_memory} -> {after.peak_memory} B")


def test_compute_keeps_its_original_order_on_a_chain():
    b = forward_dag(blocks=6)
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=10_000)
    computes = [i for i in res.order if dag.nodes[i].kind is C]
    assert computes == sorted(computes)


def test_budget_zero_never_raises_the_peak():
    b = forward_dag(blocks=4)
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=0)
    before, after = check_plan(dag, b.durations, res, 0)
    assert after.peak_memory <= before.peak_memory
    # the forward's peak is at its end and every gather would raise it: nothing can move
    assert res.moved == 0


def test_budget_zero_prefetches_where_the_original_order_has_headroom():
    # forward then backward in one graph: the peak is where the activations pile up, early blocks have room
    b = Builder()
    x = b.input("x")
    acts = []
    for i in range(4):
        a = b.coll(f"ag{i}", 2.0, out=40)
        w = b.wait(f"ag{i}_wait", a)
        x = b.compute(f"mm{i}", 3.0, x, w, out=50)
        acts.append(x)
    g = x
    for i in reversed(range(4)):
        g = b.compute(f"bw{i}", 3.0, g, acts[i], out=50)
    b.compute("out", 0.1, g, out=1, output=True)
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=0)
    before, after = check_plan(dag, b.durations, res, 0)
    assert after.peak_memory <= before.peak_memory
    assert res.moved >= 1 and after.exposed_total < before.exposed_total
    print(f"headroom: exposed {before.exposed_total} -> {after.exposed_total} ms, moved {res.moved}, "
          f"peak {before.peak_memory} -> {after.peak_memory} B")


def test_budget_limits_how_far_gathers_run_ahead():
    b = forward_dag(blocks=6, param=100, act=1, ag_ms=1.0, mm_ms=3.0)
    dag = b.dag()
    tight = plan_order(dag, b.durations, memory_budget_bytes=100)
    loose = plan_order(dag, b.durations, memory_budget_bytes=10_000)
    check_plan(dag, b.durations, tight, 100)
    check_plan(dag, b.durations, loose, 10_000)
    assert tight.after.peak_bytes <= tight.baseline_peak + 100
    assert loose.after.peak_bytes >= tight.after.peak_bytes
    assert tight.after.exposed_ms < tight.before.exposed_ms


@pytest.mark.parametrize("cap", [1, 2])
def test_max_prefetch_is_respected(cap):
    b = forward_dag(blocks=6, ag_ms=1.0, mm_ms=3.0)
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=10_000, max_prefetch=cap)
    before, after = check_plan(dag, b.durations, res, 10_000, max_prefetch=cap)
    assert max_inflight_at_fsdp_issue(dag, res.order) <= cap
    assert after.exposed_total < before.exposed_total
    free = plan_order(dag, b.durations, memory_budget_bytes=10_000)
    assert max_inflight_at_fsdp_issue(dag, free.order) > 1  # the cap is what held it back


def test_backward_reduce_scatter_waits_do_not_block_compute():
    b = backward_dag()
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=1000)
    before, after = check_plan(dag, b.durations, res, 1000)
    assert after.exposed_total < before.exposed_total
    pos = pos_of(res.order)
    idx = dag.index
    # the gradient reduction of block 3 overlaps block 2's compute: its wait comes after block 2's first
    # matmul, and the reduce-scatter is issued before it
    assert pos[idx["rs3"]] < pos[idx["dw2"]] < pos[idx["rs3_wait"]]
    assert res.wait_shift[idx["rs3_wait"]] > 0
    print(f"backward: exposed {before.exposed_total} -> {after.exposed_total} ms, "
          f"makespan {before.makespan} -> {after.makespan} ms, peak {before.peak_memory} -> {after.peak_memory} B")


def test_backward_budget_zero_keeps_peak():
    b = backward_dag()
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=0)
    before, after = check_plan(dag, b.durations, res, 0)
    assert after.peak_memory <= before.peak_memory


def test_tensor_parallel_collective_is_never_held_back():
    # FSDP gathers on "dp" capped at one in flight; a TP all-reduce on "tp" is issued as soon as its input
    # exists, regardless of the cap and the budget
    b = Builder()
    x = b.input("x")
    a0 = b.coll("ag0", 2.0, out=100)
    w0 = b.wait("ag0_wait", a0)
    h = b.compute("mm0", 2.0, x, w0, out=10)
    side = b.compute("side", 1.0, h, out=10)
    a1 = b.coll("ag1", 2.0, out=100)
    w1 = b.wait("ag1_wait", a1)
    tp = b.coll("tp_ar", 3.0, h, op=AR, group="tp", out=10, fsdp=False)
    tpw = b.wait("tp_wait", tp)
    y = b.compute("mm1", 2.0, side, w1, out=10)
    b.compute("out", 1.0, y, tpw, out=10, output=True)
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=0, max_prefetch=1)
    check_plan(dag, b.durations, res, 0, max_prefetch=1)
    pos = pos_of(res.order)
    assert pos[tp] == pos[h] + 1  # right after its input
    assert res.issue_shift[tp] > 0


def test_tp_and_fsdp_in_one_group_keep_their_sequence():
    b = Builder()
    x = b.input("x")
    prev = x
    for i in range(4):
        a = b.coll(f"ag{i}", 1.0, out=10)
        w = b.wait(f"ag{i}_wait", a)
        h = b.compute(f"mm{i}", 2.0, prev, w, out=5)
        t = b.coll(f"ar{i}", 1.0, h, op=AR, out=5, fsdp=False)
        prev = b.wait(f"ar{i}_wait", t)
    b.compute("out", 1.0, prev, out=1, output=True)
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=1000)
    before, after = check_plan(dag, b.durations, res, 1000)
    assert after.exposed_total <= before.exposed_total


def test_barrier_like_collectives_are_not_crossed():
    b = Builder()
    x = b.input("x")
    a0 = b.coll("ag0", 1.0, out=10)
    w0 = b.wait("ag0_wait", a0)
    h = b.compute("mm0", 3.0, x, w0, out=5)
    bar = b.coll("barrier", 0.5, op=CollectiveOp.OTHER, group="world", fsdp=False)
    bw = b.wait("barrier_wait", bar)
    a1 = b.coll("ag1", 1.0, out=10)
    w1 = b.wait("ag1_wait", a1)
    b.compute("mm1", 3.0, h, w1, bw, out=5, output=True)
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=1000)
    check_plan(dag, b.durations, res, 1000)
    pos = pos_of(res.order)
    assert pos[a1] > pos[bar]
    assert res.issue_shift[bar] == 0


def test_safety_net_returns_the_original_order(monkeypatch):
    b = Builder()
    a = b.coll("ag", 3.0, out=10)
    c0 = b.compute("c0", 2.0, out=1)
    w = b.wait("ag_wait", a)
    b.compute("c1", 2.0, c0, w, out=1, output=True)
    dag = b.dag()

    class WorseScheduler:
        def __init__(self, s, mm, base_curve, dur, *, limit, max_prefetch, overlap=None):
            pass

        def run(self):  # valid, but issues the gather after c0: the whole gather is exposed
            return ScheduleOutcome([c0, a, w, 3], 0, 0.0, 0.0, [""] * 4, [""] * 4, 0, 0)

    monkeypatch.setattr(plan_module, "ListScheduler", WorseScheduler)
    res = plan_order(dag, b.durations, memory_budget_bytes=0)
    assert res.order == [0, 1, 2, 3]
    assert res.moved == 0 and res.fallback and "exposes" in res.fallback
    assert res.after == res.before


def test_no_collectives_is_a_no_op():
    b = Builder()
    x = b.compute("a", 1.0, out=4)
    b.compute("b", 1.0, x, out=4, output=True)
    res = plan_order(b.dag(), b.durations, memory_budget_bytes=0)
    assert res.order == [0, 1] and res.moved == 0 and res.fallback == "no collectives"


def test_bad_arguments():
    b = forward_dag(blocks=1)
    dag = b.dag()
    with pytest.raises(ValueError):
        plan_order(dag, b.durations[:-1], memory_budget_bytes=0)
    with pytest.raises(ValueError):
        plan_order(dag, b.durations, memory_budget_bytes=-1)
    with pytest.raises(ValueError):
        plan_order(dag, b.durations, memory_budget_bytes=0, max_prefetch=0)
    with pytest.raises(ValueError, match="memory_budget_bytes=1.5; expected an int"):
        plan_order(dag, b.durations, memory_budget_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory_budget_bytes=bool"):
        plan_order(dag, b.durations, memory_budget_bytes=True)


def test_deterministic_and_independent_of_edge_insertion_order():
    b = backward_dag(blocks=5)
    dag = b.dag()
    r1 = plan_order(dag, b.durations, memory_budget_bytes=300, max_prefetch=2)
    r2 = plan_order(dag, b.durations, memory_budget_bytes=300, max_prefetch=2)
    edges = list(b.edges)
    random.Random(7).shuffle(edges)
    r3 = plan_order(Dag(b.nodes, edges), b.durations, memory_budget_bytes=300, max_prefetch=2)
    assert r1.order == r2.order == r3.order
    assert r1.reasons == r2.reasons == r3.reasons


def test_reasons_and_summary():
    b = forward_dag()
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=0)
    assert len(res.reasons) == len(dag)
    for c in dag.collectives():
        assert res.reasons[c]
    # every gather but the first was held back by the memory limit
    assert any("memory limit" in res.reasons[dag.index[f"ag{i}"]] for i in range(1, 4))
    s = res.summary()
    assert s["before"]["exposed_ms"] == 8.0 and s["memory_limit_bytes"] == res.baseline_peak
    res = plan_order(dag, b.durations, memory_budget_bytes=1000)
    lines = res.describe(dag)
    assert any(line.startswith("ag1 [collective]: prefetched") for line in lines)


# -- hoisting the feeders of a prefetch ----------------------------------------------------------------------
def copy_in_dag(blocks=6, copy_ms=1.5, ag_ms=2.0, mm_ms=3.0, param=100, act=10, tp=False):
    """Per-block bucketing: each block's gather reads a copy-in kernel (the cat of the block's shards, graph
    inputs only) that comes right before it in the original order.  With ``tp``, a tensor-parallel all-reduce
    of the first matmul's output sits between the two matmuls of every block."""
    b = Builder()
    x = b.input("x")
    shards = [b.input(f"shard{i}") for i in range(blocks)]
    for i in range(blocks):
        ci = b.compute(f"copy{i}", copy_ms, shards[i], out=param // 4)
        a = b.coll(f"ag{i}", ag_ms, ci, out=param)
        w = b.wait(f"ag{i}_wait", a)
        x = b.compute(f"mm{i}a", mm_ms, x, w, out=act, output=True)
        if tp:
            t = b.coll(f"tp{i}", 0.5, x, op=AR, group="tp", out=act, fsdp=False)
            x = b.wait(f"tp{i}_wait", t)
        x = b.compute(f"mm{i}b", mm_ms, x, w, out=act, output=True)
    return b


def test_feeders_of_the_next_gather_are_hoisted_above_the_current_block():
    b = copy_in_dag()
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=1000)
    before, after = check_plan(dag, b.durations, res, 1000)
    pos = pos_of(res.order)
    idx = dag.index
    # block 1's copy-in fits the idle time before block 0 (pulled); from block 2 on there is no idle time left
    # and the copy-in of block i+1 is hoisted above block i's compute so that its gather overlaps block i
    for i in range(1, 5):
        copy_next, ag_next, wait_next = idx[f"copy{i + 1}"], idx[f"ag{i + 1}"], idx[f"ag{i + 1}_wait"]
        first_mm = idx[f"mm{i}a"]
        assert pos[copy_next] < pos[ag_next] < pos[first_mm] < pos[wait_next], names(dag, res.order)
        assert res.reasons[copy_next] == f"hoisted: feeds the prefetch of ag{i + 1}"
        assert res.reasons[ag_next].startswith("prefetched after hoisting its 1 feeder(s)")
        assert res.issue_shift[ag_next] > 0
        # one block ahead only: nothing of block i+1 runs before block i-1 is done
        assert pos[copy_next] > pos[idx[f"mm{i - 1}b"]], names(dag, res.order)
    assert res.hoisted >= 4 and res.summary()["hoisted"] == res.hoisted
    assert any(line.startswith("copy2 [compute]: hoisted") for line in res.describe(dag))
    # the matmuls keep their order; only the first gather is (partly) exposed
    mms = [i for i in res.order if dag.nodes[i].name.startswith("mm")]
    assert mms == sorted(mms)
    assert after.exposed_total == pytest.approx(0.5)
    assert after.makespan == pytest.approx(6 * 7.5 + 0.5)
    assert before.exposed_total == pytest.approx(12.0)
    print(f"copy-in: exposed {before.exposed_total} -> {after.exposed_total} ms, makespan {before.makespan} -> "
          f"{after.makespan} ms, peak {before.peak_memory} -> {after.peak_memory} B")


def norm_then_output_dag():
    """Two blocks with copy-ins, then a norm with a tiny gathered weight and an output projection with a large
    one (as a transformer's last block, final norm and vocabulary projection)."""
    b = copy_in_dag(blocks=5)
    x = b.dag().index["mm4b"]
    n_shard, o_shard = b.input("norm_shard"), b.input("out_shard")
    ag_n = b.coll("ag_norm", 0.05, n_shard, out=1)
    x = b.compute("norm", 0.05, x, b.wait("ag_norm_wait", ag_n), out=10)
    ag_o = b.coll("ag_out", 2.5, b.compute("copy_out", 0.6, o_shard, out=25), out=100)
    b.compute("out", 3.0, x, b.wait("ag_out_wait", ag_o), out=50, output=True)
    return b


def test_gather_behind_a_short_block_is_hoisted_a_block_earlier():
    # ag_out's previous gather, ag_norm, is consumed by 0.05 ms of compute, far less than ag_out's 2.5 ms: the
    # one-block horizon looks past it, and ag_out's copy-in is hoisted into the last block, where the gather
    # hides.  (Waiting for the norm to be consumed hoisted it right before the norm: 2.45 ms exposed.)
    b = norm_then_output_dag()
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=1000)
    before, after = check_plan(dag, b.durations, res, 1000)
    pos = pos_of(res.order)
    idx = dag.index
    assert res.reasons[idx["copy_out"]] == "hoisted: feeds the prefetch of ag_out", names(dag, res.order)
    assert pos[idx["mm3b"]] < pos[idx["copy_out"]] < pos[idx["ag_out"]] < pos[idx["mm4a"]], names(dag, res.order)
    assert after.exposed[idx["ag_out"]] == pytest.approx(0.0)
    # by hand: only block 0's gather is exposed (0.5 ms beside copy1, pulled); every compute node back to
    # back: copies 5 x 1.5 + matmuls 10 x 3 + copy_out 0.6 + norm 0.05 + out 3 = 41.15 ms
    assert after.exposed_total == pytest.approx(0.5)
    assert after.makespan == pytest.approx(41.15 + 0.5)


def test_hoisting_keeps_the_memory_limit():
    b = copy_in_dag()
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=0)
    before, after = check_plan(dag, b.durations, res, 0)
    assert after.peak_memory <= before.peak_memory
    held = [res.reasons[dag.index[f"ag{i}"]] for i in range(2, 6)]
    assert any("hoisting its 1 feeder(s): memory limit" in r for r in held), held
    assert not res.reasons[dag.index["copy2"]].startswith("hoisted")
    # a budget that fits one extra gathered block and its copy-in lets the hoist through
    res = plan_order(dag, b.durations, memory_budget_bytes=125)
    check_plan(dag, b.durations, res, 125)
    assert res.reasons[dag.index["copy2"]] == "hoisted: feeds the prefetch of ag2"


def test_hoisting_never_delays_a_tensor_parallel_collective():
    b = copy_in_dag(blocks=4, tp=True)
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=1000)
    before, after = check_plan(dag, b.durations, res, 1000)
    pos = pos_of(res.order)
    idx = dag.index
    for i in range(3):
        # the TP all-reduce still follows its matmul directly; the next block's copy-in is hoisted only past
        # compute that comes after it
        assert pos[idx[f"tp{i}"]] == pos[idx[f"mm{i}a"]] + 1
        assert pos[idx[f"copy{i + 1}"]] > pos[idx[f"tp{i}"]] or res.reasons[idx[f"copy{i + 1}"]].startswith("pulled")
        assert res.issue_shift[idx[f"tp{i}"]] == 0
    assert after.exposed_total < before.exposed_total


# -- building blocks ----------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(-50, 50), st.booleans()),
                max_size=60),
       st.lists(st.integers(-100, 100), min_size=1, max_size=40),
       st.integers(1, 9))
def test_headroom_tree_matches_a_list(ops, values, block):
    # small blocks, so that ranges inside one block, across two and over whole blocks all occur
    tree = HeadroomTree(list(values), block=block)
    ref = list(values)
    n = len(ref)
    for lo, hi, v, is_add in ops:
        lo, hi = min(lo, n), min(hi, n)
        if is_add:
            tree.add(lo, hi, v)
            for k in range(lo, hi):
                ref[k] += v
        elif lo < hi:
            assert tree.max(lo, hi) == max(ref[lo:hi])



@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(-50, 50), st.integers(0, 2)),
                max_size=60),
       st.lists(st.integers(-100, 100), min_size=1, max_size=40))
def test_range_max_tree_matches_a_list(ops, values):
    # the block tree alone: range adds, point adds, range maxima and point values on any number of leaves
    tree = RangeMaxTree(list(values))
    ref = list(values)
    n = len(ref)
    for lo, hi, v, what in ops:
        lo, hi = min(lo, n), min(hi, n)
        if what == 0:
            tree.add(lo, hi, v)
            for k in range(lo, hi):
                ref[k] += v
        elif what == 1 and lo < n:
            tree.add_point(lo, v)
            ref[lo] += v
        elif lo < hi:
            assert tree.max(lo, hi) == max(ref[lo:hi])
            assert tree.value(lo) == ref[lo]
    assert tree.max(0, 0) == EMPTY_MAX

# -- random DAGs ---------------------------------------------------------------------------------------------
@st.composite
def random_dags(draw):
    """Random DAGs shaped like compiled graphs: collectives on several groups, each waited on later (most
    of the time) by a wait that aliases it, compute with random sizes, views and outputs."""
    n_target = draw(st.integers(4, 40))
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    b = Builder()
    open_colls: list[int] = []
    producers: list[int] = []  # nodes whose output compute may read (compute and waits)
    groups = ["dp", "tp", "ep"][: rnd.randint(1, 3)]
    for k in range(n_target):
        r = rnd.random()
        if r < 0.25:
            ins = rnd.sample(producers, min(len(producers), rnd.randint(0, 2)))
            op = rnd.choice([AG, AG, RS, AR, CollectiveOp.OTHER] if rnd.random() < 0.3 else [AG, RS])
            fsdp = op in (AG, RS) and rnd.random() < 0.8
            c = b.coll(f"c{k}", rnd.choice([0.0, 1.0, 2.0, 5.0]), *ins, op=op, group=rnd.choice(groups),
                       out=rnd.choice([0, 10, 50, 200]), fsdp=fsdp)
            open_colls.append(c)
        elif r < 0.45 and open_colls:
            c = open_colls.pop(rnd.randrange(len(open_colls)))
            w = b.wait(f"w{k}", c, ms=rnd.choice([0.0, 0.0, 0.5]), output=rnd.random() < 0.2)
            producers.append(w)
        elif r < 0.5:
            producers.append(b.input(f"in{k}"))
        else:
            ins = rnd.sample(producers, min(len(producers), rnd.randint(0, 3)))
            view = ins[0] if ins and rnd.random() < 0.15 else None
            x = b.compute(f"x{k}", rnd.choice([0.0, 0.5, 1.0, 3.0]), *ins, out=rnd.choice([0, 5, 20, 100]),
                          output=rnd.random() < 0.2, view_of=view)
            producers.append(x)
    for c in open_colls:
        if rnd.random() < 0.85:
            producers.append(b.wait(f"w_end{c}", c))
    # a few compute nodes at the end read waits, so that waits have consumers
    tail = [p for p in producers if b.nodes[p].kind is W]
    if tail:
        b.compute("tail", 1.0, *rnd.sample(tail, min(3, len(tail))), out=5, output=True)
    budget = draw(st.sampled_from([0, 0, 10, 100, 1000, 10**6]))
    cap = draw(st.sampled_from([None, None, 1, 2, 3]))
    return b, budget, cap


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags())
def test_random_dags_keep_every_guarantee(case):
    b, budget, cap = case
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=budget, max_prefetch=cap)
    check_plan(dag, b.durations, res, budget, max_prefetch=cap)
    assert len(res.reasons) == len(dag)
    again = plan_order(dag, b.durations, memory_budget_bytes=budget, max_prefetch=cap)
    assert again.order == res.order


@settings(max_examples=150, deadline=None)
@given(random_dags(), st.integers(0, 2**31))
def test_trackers_agree_with_the_simulator(case, seed):
    b, _, _ = case
    dag = b.dag()
    # a random valid order (random topological sort that keeps the group sequences)
    order = _random_valid_order(dag, random.Random(seed))
    assert dag.order_violations(order) == []
    s = Structure(dag)
    mm = MemoryModel(dag)
    assert mm.curve(order) == memory_curve(dag, order)
    mine = evaluate(dag, order, b.durations)
    tl = simulate(dag, order, b.durations)
    # the verification replay's loop without a clock, to the last digit
    assert exposed_and_makespan(dag, order, b.durations, s.coll_of, None, s.group) == (tl.exposed_total, tl.makespan)
    assert mine.exposed_ms == pytest.approx(tl.exposed_total)
    assert mine.makespan_ms == pytest.approx(tl.makespan)
    assert mine.peak_bytes == tl.peak_memory


@settings(max_examples=150, deadline=None)
@given(random_dags())
def test_scheduler_time_and_memory_match_the_simulator(case):
    # the scheduler's own simulated clock and live bytes, for the order it builds, are the simulator's
    b, budget, cap = case
    dag = b.dag()
    s = Structure(dag)
    mm = MemoryModel(dag)
    base = mm.curve(range(len(dag)))
    limit = max(base, default=0) + budget
    for lim in (limit, None):
        out = ListScheduler(s, mm, base, b.durations, limit=lim, max_prefetch=cap).run()
        assert dag.order_violations(out.order) == []
        tl = simulate(dag, out.order, b.durations)
        assert out.exposed == pytest.approx(tl.exposed_total)
        assert out.makespan == pytest.approx(tl.makespan)
        assert out.peak == tl.peak_memory


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags())
def test_planner_predictions_are_the_simulators_to_the_last_digit(case):
    # the figures the scheduling pass tracked while building its order, against a replay of that order
    b, budget, cap = case
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=budget, max_prefetch=cap)
    tl = simulate(dag, res.order, b.durations)
    assert res.predicted.makespan_ms == tl.makespan
    assert res.predicted.peak_bytes == tl.peak_memory
    assert res.predicted.exposed_ms == tl.exposed_total


def _random_valid_order(dag, rnd):
    n = len(dag)
    indeg = [len(p) for p in dag.preds]
    seqs = dag.group_sequences()
    nxt = {g: 0 for g in seqs}
    ready = [i for i in range(n) if indeg[i] == 0]
    order = []
    while ready:
        ok = [i for i in ready if dag.nodes[i].kind is not K
              or seqs[dag.nodes[i].group_name or "?"][nxt[dag.nodes[i].group_name or "?"]] == i]
        i = rnd.choice(ok)
        ready.remove(i)
        order.append(i)
        if dag.nodes[i].kind is K:
            nxt[dag.nodes[i].group_name or "?"] += 1
        for v in dag.succs[i]:
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    return order


# -- scale ---------------------------------------------------------------------------------------------------
def big_fsdp_dag(layers: int, per_block: int = 10):
    """Forward + backward of ``layers`` blocks with reshard-after-forward: 2 * layers * (per_block + 3)
    nodes."""
    b = Builder()
    x = b.input("x")
    acts = []
    for i in range(layers):
        a = b.coll(f"f_ag{i}", 1.0, out=1000)
        w = b.wait(f"f_ag{i}_wait", a)
        for j in range(per_block):
            x = b.compute(f"f{i}_{j}", 0.2, x, w, out=10)
        acts.append(x)
    g = x
    for i in reversed(range(layers)):
        a = b.coll(f"b_ag{i}", 1.0, out=1000)
        w = b.wait(f"b_ag{i}_wait", a)
        gw = b.compute(f"dw{i}", 0.2, g, acts[i], out=1000)
        for j in range(per_block - 1):
            g = b.compute(f"b{i}_{j}", 0.2, g, w, out=10)
        r = b.coll(f"rs{i}", 1.0, gw, op=RS, out=250)
        b.wait(f"rs{i}_wait", r, output=True)
    b.compute("loss", 0.1, g, out=1, output=True)
    return b


def test_hundred_thousand_nodes_plan_in_seconds():
    layers = 100_000 // 26 + 1
    b = big_fsdp_dag(layers)
    dag = b.dag()
    assert len(dag) >= 100_000
    t0 = time.perf_counter()
    res = plan_order(dag, b.durations, memory_budget_bytes=5000)
    elapsed = time.perf_counter() - t0
    assert dag.order_violations(res.order) == []
    assert res.after.peak_bytes <= res.baseline_peak + 5000
    assert res.after.exposed_ms <= res.before.exposed_ms
    assert res.fallback is None and res.moved > 0
    print(f"{len(dag)} nodes planned in {elapsed:.2f} s (passes {res.passes}); exposed "
          f"{res.before.exposed_ms:.1f} -> {res.after.exposed_ms:.1f} ms, makespan {res.before.makespan_ms:.1f} -> "
          f"{res.after.makespan_ms:.1f} ms, moved {res.moved}")


def test_a_gathered_blocks_wait_stays_at_its_first_consumer_not_at_its_predicted_finish():
    # per block a copy-in kernel feeds the gather (its buffer is freed when the gather's wait runs); the
    # gather of block i+1 is prefetched during block i and finishes (2 ms) well before block i ends (6 ms)
    b = Builder()
    x = b.input("x")
    for i in range(3):
        copy_in = b.compute(f"copy_in{i}", 0.01, out=50)
        a = b.coll(f"ag{i}", 2.0, copy_in, out=100)
        w = b.wait(f"ag{i}_wait", a)
        x = b.compute(f"mm{i}a", 3.0, x, w, out=10, output=True)
        x = b.compute(f"mm{i}b", 3.0, x, w, out=10, output=True)
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=1000)
    check_plan(dag, b.durations, res, 1000)
    order = names(dag, res.order)
    for i in (1, 2):
        assert order.index(f"ag{i}") < order.index(f"mm{i - 1}a"), order  # prefetched a block ahead
        # right before the block that needs it, not inside the block before (where freeing the 50 B copy-in
        # buffer would have put it): a transfer later than predicted must not block compute that does not
        # need it
        assert order.index(f"ag{i}_wait") == order.index(f"mm{i}a") - 1, order


def test_a_reductions_wait_is_held_until_the_next_blocks_reduction_is_issued():
    # per block a 4 ms weight-gradient matmul feeds a 2 ms reduce-scatter whose wait frees the gradient: in the
    # simulator it is done half-way through the next block; on a real link a transfer slower than predicted
    # would block there, so the wait goes after the next block's reduce-scatter is issued (one block of slack)
    b = backward_dag(blocks=4, mm_ms=4.0, ag_ms=2.0, rs_ms=2.0)
    dag = b.dag()
    res = plan_order(dag, b.durations, memory_budget_bytes=1000)
    check_plan(dag, b.durations, res, 1000)
    order = names(dag, res.order)
    for i in (3, 2, 1):
        assert order.index(f"rs{i}_wait") > order.index(f"rs{i - 1}"), order
    # nothing is slower for it: every transfer hides under a matmul, the step is its compute (4 blocks of
    # 8 ms and the loss)
    timeline = simulate(dag, res.order, b.durations)
    assert timeline.exposed_total == pytest.approx(0.0)
    assert timeline.makespan == pytest.approx(4 * 8.0 + 0.5)
    # with no memory to spare the limit places them earlier again (check_plan: the baseline peak is kept)
    tight = plan_order(dag, b.durations, memory_budget_bytes=0)
    check_plan(dag, b.durations, tight, 0)
    order = names(dag, tight.order)
    for i in (3, 2, 1):
        assert order.index(f"rs{i}_wait") < order.index(f"rs{i - 1}"), order
