"""Timeline simulator: hand-computed timelines, memory rules, order checks, bounds, trace export."""

from __future__ import annotations

import json

import pytest

from fsdp_passes.dag import CollectiveOp, Dag, DagNode, NodeKind
from fsdp_passes.simulate import (
    Timeline,
    chrome_trace,
    lower_bound,
    memory_curve,
    peak_memory,
    simulate,
    write_chrome_trace,
)

from fsdp_passes.testing import DagBuilder

C, K, W = NodeKind.COMPUTE, NodeKind.COLLECTIVE, NodeKind.WAIT


Builder = DagBuilder


def approx(x):
    return pytest.approx(x, abs=1e-9)


# -- hand-computed timelines ------------------------------------------------------------------------------
def test_prefetched_all_gather_exposes_the_part_compute_does_not_cover():
    b = Builder()
    b.compute("c0", 2)
    ag = b.coll("ag", 3)
    w = b.wait("w", ag)
    b.compute("c1", 2, w, 0)
    dag = b.dag()
    tl = simulate(dag, b.order("ag", "c0", "w", "c1"), b.durations)
    assert isinstance(tl, Timeline)
    assert tl.start[ag] == 0 and tl.end[ag] == 3
    assert tl.issue[w] == 2 and tl.end[w] == 3
    assert tl.exposed == {ag: approx(1.0)}
    assert tl.exposed_total == approx(1.0)
    assert tl.wait_blocked == {w: approx(1.0)}
    assert tl.makespan == approx(5.0)
    assert tl.compute_busy == approx(4.0)
    assert tl.compute_idle == approx(1.0)
    assert tl.comm_time == {"0": approx(3.0)}
    assert tl.lower_bound <= tl.makespan


def test_a_wait_ends_exactly_when_its_collective_does():
    # 0.673 + (6.2485 - 0.673) rounds one ulp below 6.2485: the wait must not end before its collective
    b = Builder()
    b.compute("c0", 0.6731135254387071)
    ag = b.coll("ag", 6.248512067058468)
    w = b.wait("w", ag)
    tl = simulate(b.dag(), b.order("ag", "c0", "w"), b.durations)
    assert tl.end[w] == tl.end[ag] == 6.248512067058468


def test_issuing_late_exposes_the_whole_collective():
    b = Builder()
    b.compute("c0", 2)
    ag = b.coll("ag", 3)
    w = b.wait("w", ag)
    b.compute("c1", 2, w, 0)
    tl = simulate(b.dag(), b.order("c0", "ag", "w", "c1"), b.durations)
    assert tl.start[ag] == 2 and tl.exposed[ag] == approx(3.0) and tl.makespan == approx(7.0)


def test_same_group_collectives_run_one_after_another():
    b = Builder()
    a1 = b.coll("ag1", 3, group="dp")
    a2 = b.coll("ag2", 4, group="dp")
    b.compute("c", 1)
    w1 = b.wait("w1", a1)
    w2 = b.wait("w2", a2)
    b.compute("d", 1, w1, w2)
    tl = simulate(b.dag(), b.order("ag1", "ag2", "c", "w1", "w2", "d"), b.durations)
    assert (tl.start[a2], tl.end[a2]) == (3.0, 7.0)
    assert tl.issue[a2] == 0.0
    assert tl.exposed == {a1: approx(2.0), a2: approx(4.0)}
    assert tl.makespan == approx(8.0)
    assert tl.comm_time == {"dp": approx(7.0)}


def test_two_groups_run_in_parallel():
    b = Builder()
    a1 = b.coll("ag1", 3, group="dp")
    a2 = b.coll("ag2", 4, group="tp")
    b.compute("c", 1)
    w1 = b.wait("w1", a1)
    w2 = b.wait("w2", a2)
    b.compute("d", 1, w1, w2)
    tl = simulate(b.dag(), b.order("ag1", "ag2", "c", "w1", "w2", "d"), b.durations)
    assert (tl.start[a2], tl.end[a2]) == (0.0, 4.0)
    assert tl.exposed == {a1: approx(2.0), a2: approx(1.0)}
    assert tl.makespan == approx(5.0)
    assert tl.comm_time == {"dp": approx(3.0), "tp": approx(4.0)}


def test_collective_queues_behind_a_busy_group_stream():
    b = Builder()
    a1 = b.coll("rs1", 5, group="dp", op=CollectiveOp.REDUCE_SCATTER)
    b.compute("c", 1)
    a2 = b.coll("rs2", 1, group="dp", op=CollectiveOp.REDUCE_SCATTER)
    b.compute("e", 2)
    b.wait("w1", a1)
    b.wait("w2", a2)
    tl = simulate(b.dag(), b.order("rs1", "c", "rs2", "e", "w1", "w2"), b.durations)
    assert tl.issue[a2] == 1.0 and tl.start[a2] == 5.0 and tl.end[a2] == 6.0
    assert tl.exposed == {a1: approx(2.0), a2: approx(1.0)}
    assert tl.makespan == approx(6.0)


def test_unwaited_collective_is_exposed_past_the_end_of_compute():
    b = Builder()
    b.compute("c0", 2)
    rs = b.coll("rs", 5, 0, op=CollectiveOp.REDUCE_SCATTER)
    tl = simulate(b.dag(), [0, 1], b.durations)
    assert tl.compute_end == approx(2.0)
    assert tl.makespan == approx(7.0)
    assert tl.exposed == {rs: approx(5.0)}
    assert tl.compute_idle == approx(5.0)


def test_a_wait_that_does_not_block_costs_nothing_and_its_own_duration_is_compute():
    b = Builder()
    ag = b.coll("ag", 1)
    b.compute("c0", 4)
    w = b.wait("w", ag, ms=0.5)
    tl = simulate(b.dag(), [0, 1, 2], b.durations)
    assert tl.exposed[ag] == 0.0 and tl.wait_blocked[w] == 0.0
    assert tl.end[w] == approx(4.5) and tl.compute_busy == approx(4.5) and tl.makespan == approx(4.5)


# -- memory -----------------------------------------------------------------------------------------------
def test_memory_holds_collective_inputs_until_the_wait():
    b = Builder()
    a = b.compute("a", 1, out=100)
    rs = b.coll("rs", 1, a, out=10, op=CollectiveOp.REDUCE_SCATTER)
    b.compute("b", 1, out=50)
    w = b.wait("w", rs)
    b.compute("c", 1, w, out=1, output=True)
    dag = b.dag()
    order = b.order("a", "rs", "b", "w", "c")
    # a is read by NCCL until w; b has no user and dies right after it runs; rs's buffer dies after c
    assert memory_curve(dag, order) == [100, 110, 160, 110, 11]
    assert peak_memory(dag, order) == 160
    # waiting earlier frees a earlier
    order2 = b.order("a", "rs", "w", "b", "c")
    assert memory_curve(dag, order2) == [100, 110, 110, 60, 11]
    assert simulate(dag, order2, b.durations).peak_memory == 110


def test_memory_follows_alias_chains_and_outputs():
    b = Builder()
    x = b.compute("x", 1, out=64)
    v1 = b.compute("v1", 0, x, view_of=x)
    v2 = b.compute("v2", 0, v1, view_of=v1)
    b.compute("y", 1, out=8)
    b.compute("z", 1, v2, out=2)
    o = b.compute("o", 1, out=4)
    b.compute("ov", 0, o, view_of=o, output=True)  # an output view keeps its base alive to the end
    b.compute("t", 1, out=16)
    dag = b.dag()
    order = list(range(len(dag)))
    # x lives until z (through two views), y dies at once, o lives to the end via its output view
    assert memory_curve(dag, order) == [64, 64, 64, 72, 66, 4, 4, 20]


def test_unwaited_collective_holds_its_inputs_to_the_end_and_graph_inputs_are_free():
    nodes = [
        DagNode("inp", C, op="placeholder", out_bytes=1000),
        DagNode("g", C, out_bytes=5),
        DagNode("rs", K, collective=CollectiveOp.REDUCE_SCATTER, group_name="0", out_bytes=1),
        DagNode("h", C, out_bytes=7),
    ]
    dag = Dag(nodes, [(0, 1), (1, 2)])
    assert memory_curve(dag, [0, 1, 2, 3]) == [0, 5, 6, 12]


def test_memory_never_counts_a_wait_twice():
    b = Builder()
    ag = b.coll("ag", 1, out=32)
    w = b.wait("w", ag)
    b.compute("c", 1, w, out=1)
    assert memory_curve(b.dag(), [0, 1, 2]) == [32, 32, 33]


def test_each_of_several_buffers_is_freed_after_its_own_last_reader():
    from fsdp_passes.dag.graph import OutputBuffer

    # k writes three buffers: a (40 B) read by r1, b (20 B) read by r2 (last), and t (100 B) computed inside k
    # only (no memory holds it); r1 and r2 allocate 1 B each, r2 is returned
    bufs = (OutputBuffer(40, ("r1",)), OutputBuffer(20, ("r2",)), OutputBuffer(100, allocated=False))
    nodes = [DagNode("k", C, out_bytes=60, non_owning_bytes=100, output_buffers=bufs),
             DagNode("r1", C, out_bytes=1), DagNode("x", C, out_bytes=30), DagNode("r2", C, out_bytes=1, is_output=True)]
    dag = Dag(nodes, [(0, 1), (0, 3), (1, 2)])
    # a is freed after r1, so x runs with b and r1's output (x reads it): 20 + 1 + 30; as one buffer, k's
    # 60 B would live until r2 (91 at x)
    assert memory_curve(dag, [0, 1, 2, 3]) == [60, 61, 51, 21]
    # a buffer the graph returns stays to the end; the one nobody reads dies with its node
    ret = (OutputBuffer(40, (), graph_output=True), OutputBuffer(20, ("r1",)))
    nodes = [DagNode("k", C, out_bytes=60, is_output=True, graph_output_bytes=40, output_buffers=ret),
             DagNode("r1", C, out_bytes=1), DagNode("x", C, out_bytes=30)]
    dag = Dag(nodes, [(0, 1), (1, 2)])
    assert memory_curve(dag, [0, 1, 2]) == [60, 61, 71]


# -- lower bound ------------------------------------------------------------------------------------------
def test_lower_bound_head_comm_tail_is_tight_when_the_order_hides_everything():
    b = Builder()
    p = b.compute("p", 2)
    ag = b.coll("ag", 5, p)
    w = b.wait("w", ag)
    b.compute("q", 3, w)
    b.compute("r", 1)
    dag = b.dag()
    assert lower_bound(dag, b.durations) == approx(10.0)
    tl = simulate(dag, b.order("p", "ag", "r", "w", "q"), b.durations)
    assert tl.makespan == approx(10.0) and tl.lower_bound == approx(10.0)


def test_lower_bound_is_total_compute_without_collectives():
    b = Builder()
    b.compute("a", 1.5)
    b.compute("b", 2.5, 0)
    assert lower_bound(b.dag(), b.durations) == approx(4.0)


def test_lower_bound_uses_the_best_window_of_a_group():
    # the second collective needs 4 ms of compute first; the first one needs none: 4 + 1 + 0 beats 0 + 2 + 0
    b = Builder()
    a1 = b.coll("a1", 1)
    x = b.compute("x", 4)
    a2 = b.coll("a2", 1, x)
    b.wait("w1", a1)
    b.wait("w2", a2)
    assert lower_bound(b.dag(), b.durations) == approx(5.0)


# -- invalid input ----------------------------------------------------------------------------------------
def _small():
    b = Builder()
    b.compute("c0", 1)
    a1 = b.coll("ag1", 1)
    a2 = b.coll("ag2", 1)
    b.wait("w1", a1)
    b.wait("w2", a2)
    return b


@pytest.mark.parametrize(
    "order, match",
    [
        ([0, 1, 2, 3], "leaves out node w2"),
        ([0, 1, 2, 3, 3], "places node w1 twice"),
        ([0, 1, 2, 3, 7], "outside 0..4"),
        ([0, 1, 3, 2, 4], None),  # fine: waits may reorder with other collectives
        ([0, 3, 1, 2, 4], "w1 is placed before its input ag1"),
        ([0, 2, 1, 3, 4], "ag2 is issued before ag1"),
    ],
)
def test_invalid_orders_raise_naming_the_node(order, match):
    b = _small()
    dag = b.dag()
    if match is None:
        simulate(dag, order, b.durations)
        return
    with pytest.raises(ValueError, match=match):
        simulate(dag, order, b.durations)


@pytest.mark.parametrize("durations", [[1, 1, 1, 1], [1, 1, -1, 1, 1], [1, 1, float("nan"), 1, 1]])
def test_bad_durations_raise(durations):
    b = _small()
    with pytest.raises(ValueError):
        simulate(b.dag(), [0, 1, 2, 3, 4], durations)


def test_empty_dag():
    dag = Dag([], [])
    tl = simulate(dag, [], [])
    assert tl.makespan == 0 and tl.peak_memory == 0 and tl.lower_bound == 0 and tl.memory == []


# -- trace --------------------------------------------------------------------------------------------------
def test_chrome_trace_has_a_process_per_run_and_a_thread_per_stream(tmp_path):
    b = Builder()
    b.compute("c0", 2, out=4)
    ag = b.coll("ag", 3, group="dp", out=100)
    rs = b.coll("rs", 1, 0, group="tp", op=CollectiveOp.REDUCE_SCATTER, out=10)
    w = b.wait("w", ag)
    b.wait("wr", rs)
    b.compute("c1", 2, w, 0, out=1)
    dag = b.dag()
    before = simulate(dag, b.order("c0", "ag", "rs", "w", "wr", "c1"), b.durations)
    after = simulate(dag, b.order("ag", "c0", "rs", "w", "wr", "c1"), b.durations)
    trace = chrome_trace({"before": (dag, before), "after": (dag, after)})
    assert trace["displayTimeUnit"] == "ms"
    ev = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {1: "before", 2: "after"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"
    }
    for pid in (1, 2):
        assert sorted(n for (p, _), n in threads.items() if p == pid) == ["compute", "pg dp", "pg tp"]
    slices = [e for e in ev if e["ph"] == "X"]
    compute_tid = {p: t for (p, t), n in threads.items() if n == "compute"}
    for pid, tl in ((1, before), (2, after)):
        mine = {e["name"]: e for e in slices if e["pid"] == pid}
        assert {"c0", "c1", "ag", "rs"} <= set(mine)
        assert mine["ag"]["tid"] == next(t for (p, t), n in threads.items() if p == pid and n == "pg dp")
        assert mine["ag"]["ts"] == tl.start[ag] * 1000 and mine["ag"]["dur"] == approx(3000)
        assert mine["ag"]["args"]["exposed_ms"] == approx(tl.exposed[ag])
        assert mine["ag"]["args"]["bytes"] == 100 and mine["ag"]["args"]["kind"] == "collective"
        assert mine["c1"]["tid"] == compute_tid[pid] and mine["c1"]["args"]["bytes"] == 1
    waits = {e["pid"]: e for e in slices if e["name"] == "wait ag"}
    assert set(waits) == {1, 2}  # blocked 3 ms before, 1 ms after
    assert waits[1]["dur"] == approx(3000) and waits[2]["dur"] == approx(1000)
    assert waits[1]["tid"] == compute_tid[1] and waits[1]["args"]["exposed_ms"] == approx(3.0)
    assert not any(e["name"] == "wait rs" for e in slices)  # rs finished before its wait: no slice
    counters = [e for e in ev if e["ph"] == "C" and e["pid"] == 1]
    assert max(e["args"]["bytes"] for e in counters) == before.peak_memory
    path = tmp_path / "sub" / "trace.json"
    write_chrome_trace(path, {"before": (dag, before)})
    loaded = json.loads(path.read_text())
    assert {e["args"]["name"] for e in loaded["traceEvents"] if e["name"] == "process_name"} == {"before"}


# -- performance --------------------------------------------------------------------------------------------
def _layered(layers: int, per_layer: int = 10) -> tuple[Dag, list[float]]:
    """FSDP-like chain: per layer an all-gather (prefetched one layer ahead), its wait, compute, and a
    reduce-scatter of a gradient on another group."""
    nodes: list[DagNode] = []
    edges: list[tuple[int, int]] = []
    durs: list[float] = []
    prev = -1
    for layer in range(layers):
        ag = len(nodes)
        nodes.append(DagNode(f"ag{layer}", K, group_name="dp", out_bytes=1 << 20))
        durs.append(0.3)
        nodes.append(DagNode(f"wag{layer}", W, alias_of=ag, collective_of=ag))
        edges.append((ag, ag + 1))
        durs.append(0.0)
        last = ag + 1
        for k in range(per_layer):
            i = len(nodes)
            nodes.append(DagNode(f"mm{layer}_{k}", C, out_bytes=4096))
            durs.append(0.05)
            edges.append((last, i))
            if prev >= 0:
                edges.append((prev, i))
            last = i
        rs = len(nodes)
        nodes.append(DagNode(f"rs{layer}", K, group_name="rs", out_bytes=1 << 18))
        durs.append(0.2)
        edges.append((last, rs))
        nodes.append(DagNode(f"wrs{layer}", W, alias_of=rs, collective_of=rs, is_output=True))
        edges.append((rs, rs + 1))
        durs.append(0.0)
        prev = last
    return Dag(nodes, edges), durs


def test_100k_nodes_simulate():
    # its time is a target of benchmarks/pass_scaling.py, not of this test
    dag, durs = _layered(7143)  # 14 nodes a layer: ~100k nodes
    assert len(dag) >= 100_000
    order = list(range(len(dag)))
    tl = simulate(dag, order, durs)
    assert tl.makespan >= tl.lower_bound > 0
