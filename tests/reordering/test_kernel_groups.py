"""Kernel groups (nodes emitted as one generated kernel while adjacent) kept whole by the reordering."""

from __future__ import annotations

from fsdp_passes.reordering import plan_order
from fsdp_passes.reordering.kernel_groups import keep_kernel_groups_whole
from fsdp_passes.testing import DagBuilder


def _grouped(b: DagBuilder, group: int, *names: str) -> None:
    for i in b.order(*names):
        b.nodes[i].kernel_group = group


def _block() -> DagBuilder:
    """x -> a1 -> a2 (one kernel group) -> y; an all-gather issued off x, its wait read by y."""
    b = DagBuilder()
    x = b.compute("x", 1.0, out=10)
    a1 = b.compute("a1", 1.0, x, out=10)
    a2 = b.compute("a2", 1.0, a1, out=10)
    ag = b.coll("ag", 2.0, x, out=100)
    w = b.wait("ag_wait", ag)
    b.compute("y", 1.0, a2, w, out=10, output=True)
    _grouped(b, 0, "a1", "a2")
    return b


def _names(b: DagBuilder, order: list[int]) -> list[str]:
    return [b.nodes[i].name for i in order]


def test_a_collective_issued_inside_a_group_moves_before_it_and_a_wait_after_it():
    b = _block()
    dag = b.dag()
    order, regrouped = keep_kernel_groups_whole(dag, b.order("x", "a1", "ag", "a2", "ag_wait", "y"))
    assert (_names(b, order), regrouped) == (["x", "ag", "a1", "a2", "ag_wait", "y"], 1)
    order, regrouped = keep_kernel_groups_whole(dag, b.order("x", "ag", "a1", "ag_wait", "a2", "y"))
    assert (_names(b, order), regrouped) == (["x", "ag", "a1", "a2", "ag_wait", "y"], 1)
    whole = b.order("x", "a1", "a2", "ag", "ag_wait", "y")
    assert keep_kernel_groups_whole(dag, whole) == (whole, 0)


def test_what_feeds_a_later_member_goes_before_and_what_reads_an_earlier_one_after():
    b = DagBuilder()
    x = b.compute("x", 1.0, out=10)
    ag = b.coll("ag", 2.0, x, out=100)
    w = b.wait("ag_wait", ag)
    a1 = b.compute("a1", 1.0, x, out=10)
    b.compute("a2", 1.0, a1, w, out=10)  # reads the gathered value
    b.compute("z", 1.0, a1, out=10, output=True)  # reads a1 only
    _grouped(b, 0, "a1", "a2")
    order, regrouped = keep_kernel_groups_whole(b.dag(), b.order("x", "ag", "a1", "z", "ag_wait", "a2"))
    assert (_names(b, order), regrouped) == (["x", "ag", "ag_wait", "a1", "a2", "z"], 1)


def test_refused_arrangements_fall_back_to_the_next_then_to_the_split():
    b = _block()
    dag = b.dag()
    split = b.order("x", "a1", "ag", "ag_wait", "a2", "y")
    seen: list[list[str]] = []

    def refuse(first: int):
        def fits(order: list[int]) -> bool:
            seen.append(_names(b, order))
            return len(seen) > first
        return fits

    order, regrouped = keep_kernel_groups_whole(dag, split, fits=refuse(2))
    assert seen == [["x", "ag", "a1", "a2", "ag_wait", "y"],  # the prefetch kept, the wait after the group
                    ["x", "a1", "a2", "ag", "ag_wait", "y"],  # both after it
                    ["x", "ag", "ag_wait", "a1", "a2", "y"]]  # both before it: accepted
    assert (_names(b, order), regrouped) == (seen[-1], 1)
    assert keep_kernel_groups_whole(dag, split, fits=lambda order: False) == (split, 0)


def test_an_arrangement_that_would_reorder_a_process_groups_collectives_is_skipped():
    b = DagBuilder()
    a1 = b.compute("a1", 1.0, out=10)
    b.compute("a2", 1.0, a1, out=10, output=True)
    first = b.coll("rs_first", 2.0, a1, out=10)  # reads a1: must stay after it
    second = b.coll("ag_second", 2.0, out=10)  # same group, issued after rs_first
    b.wait("rs_wait", first, output=True)
    b.wait("ag_wait", second, output=True)
    _grouped(b, 0, "a1", "a2")
    dag = b.dag()
    split = b.order("a1", "rs_first", "ag_second", "a2", "rs_wait", "ag_wait")
    seen: list[list[str]] = []

    def fits(order: list[int]) -> bool:
        seen.append(_names(b, order))
        return True

    order, regrouped = keep_kernel_groups_whole(dag, split, fits=fits)
    # the prefetch kept (ag_second before the group, rs_first after it) would swap the two: never tried
    assert seen == [["a1", "a2", "rs_first", "ag_second", "rs_wait", "ag_wait"]]
    assert (_names(b, order), regrouped) == (seen[0], 1)
    # that one refused, the last (ag_second before the group) would swap them too: never tried, left split
    refused: list[list[str]] = []
    assert keep_kernel_groups_whole(dag, split, fits=lambda order: refused.append(order) and False) == (split, 0)
    assert len(refused) == 1


def _blocks(marked: bool, tail_ms: float) -> DagBuilder:
    """Three blocks: gather, matmul, two pointwise kernels (one group when ``marked``), the first the last
    reader of the gathered weight (so the memory limit lets the next gather start only after it), then
    ``tail_ms`` of compute that needs no weight."""
    b = DagBuilder()
    x = b.compute("x0", 0.1, out=10)
    for i in range(3):
        ag = b.coll(f"ag{i}", 2.0, out=100)
        w = b.wait(f"ag{i}_wait", ag)
        m = b.compute(f"mm{i}", 1.0, x, w, out=10)
        p1 = b.compute(f"pw{i}a", 0.5, m, w, out=10)
        x = b.compute(f"pw{i}b", 0.5, p1, out=10)
        x = b.compute(f"tail{i}", tail_ms, x, out=10)
        if marked:
            _grouped(b, i, f"pw{i}a", f"pw{i}b")
    b.compute("out", 0.1, x, out=10, output=True)
    return b


def _whole(b: DagBuilder, order: list[int]) -> list[bool]:
    names = _names(b, order)
    return [names.index(f"pw{i}b") == names.index(f"pw{i}a") + 1 for i in range(3)]


def test_plan_order_keeps_a_group_whole_that_the_scheduling_pass_splits_when_that_costs_nothing():
    """Planned without the marks, the pass issues the next block's all-gather inside the group (where the
    last reader of the gathered weight frees it); with them every group is whole, within the memory limit,
    and the simulated step is the unmarked plan's (the block's tail hides the gather issued 0.5 ms later)."""
    plain = _blocks(marked=False, tail_ms=3.0)
    unmarked = plan_order(plain.dag(), plain.durations, memory_budget_bytes=0)
    assert _whole(plain, unmarked.order) == [False, False, True], _names(plain, unmarked.order)
    b = _blocks(marked=True, tail_ms=3.0)
    res = plan_order(b.dag(), b.durations, memory_budget_bytes=0)
    assert res.fallback is None and res.regrouped == 2
    assert _whole(b, res.order) == [True, True, True], _names(b, res.order)
    assert res.after.peak_bytes <= res.memory_limit and not b.dag().order_violations(res.order)
    assert (res.after.exposed_ms, res.after.makespan_ms) <= (unmarked.after.exposed_ms, unmarked.after.makespan_ms)
    assert res.after.exposed_ms < res.before.exposed_ms  # still overlapping


def test_plan_order_leaves_a_group_split_when_mending_it_would_slow_the_step():
    """With a short tail the gather issued after the group would be exposed longer: the groups stay as the
    pass split them and the order is the unmarked plan's."""
    plain = _blocks(marked=False, tail_ms=0.1)
    unmarked = plan_order(plain.dag(), plain.durations, memory_budget_bytes=0)
    b = _blocks(marked=True, tail_ms=0.1)
    res = plan_order(b.dag(), b.durations, memory_budget_bytes=0)
    assert _whole(b, res.order) == [False, False, True]
    assert (res.order, res.regrouped) == (unmarked.order, 0)
