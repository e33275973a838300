"""The overlap-aware lower bound against every valid order of small graphs (exhaustive search), and the split
of a simulated makespan into its parts against timelines computed by hand."""

from __future__ import annotations

import pytest

from fsdp_passes.dag.graph import CollectiveOp
from fsdp_passes.simulate import OverlapCosts, gap_parts, lower_bound, overlap_lower_bound, simulate
from fsdp_passes.testing import DagBuilder

SLOW = OverlapCosts(compute_slowdown=0.5)  # compute runs 1.5x slower beside a collective


def _all_orders(dag):
    """Every valid order of a small ``dag``: topological, each group's collectives in their id order."""
    seqs = dag.group_sequences()
    next_in_group = {c: seq[k - 1] if k else None for seq in seqs.values() for k, c in enumerate(seq)}
    n = len(dag.nodes)
    placed = [False] * n
    order: list[int] = []

    def ready(i: int) -> bool:
        if placed[i] or not all(placed[p] for p in dag.preds[i]):
            return False
        before = next_in_group.get(i)
        return before is None or placed[before]

    def walk():
        if len(order) == n:
            yield list(order)
            return
        for i in range(n):
            if ready(i):
                placed[i] = True
                order.append(i)
                yield from walk()
                order.pop()
                placed[i] = False

    yield from walk()


def _forward_like():
    """Two gathers, the second needed only by the second matmul: the first is exposed, the second hides under
    mm0 (slowing it)."""
    b = DagBuilder()
    ag0 = b.coll("ag0", 2.0)
    ag1 = b.coll("ag1", 1.5)
    w0 = b.wait("w0", ag0)
    w1 = b.wait("w1", ag1)
    mm0 = b.compute("mm0", 3.0, w0)
    b.compute("mm1", 3.0, mm0, w1, output=True)
    return b


def _backward_like():
    """A gather, two matmuls and a reduce-scatter of the first one's gradient beside the second."""
    b = DagBuilder()
    x = b.input("x")
    ag0 = b.coll("ag0", 2.0, x)
    side = b.compute("side", 1.0, x)
    w0 = b.wait("w0", ag0)
    mm0 = b.compute("mm0", 3.0, w0, side)
    rs = b.coll("rs", 1.5, mm0, op=CollectiveOp.REDUCE_SCATTER)
    b.wait("w_rs", rs, output=True)
    b.compute("mm1", 2.0, mm0, output=True)
    return b


def test_an_order_reaches_the_overlap_bound():
    # by hand: ag0 0..2 exposed (nothing else can run), ag1 2..3.5 beside mm0: mm0 does 1 ms of its work in
    # those 1.5 ms, the other 2 ms after (ends 5.5), mm1 5.5..8.5.  The bound's j = k = 0 term: all comm 3.5
    # + the tail of ag0 (6 ms of work) less what fits beside ag1 (1.5 / 1.5 = 1 ms) = 8.5
    b = _forward_like()
    dag = b.dag()
    tl = simulate(dag, b.order("ag0", "ag1", "w0", "mm0", "w1", "mm1"), b.durations, SLOW)
    assert tl.makespan == pytest.approx(8.5)
    assert overlap_lower_bound(dag, b.durations, SLOW) == pytest.approx(8.5)
    assert lower_bound(dag, b.durations) == pytest.approx(8.0)  # ag0 + all compute: the slowdown not counted


@pytest.mark.parametrize("build", [_forward_like, _backward_like])
@pytest.mark.parametrize("overlap", [OverlapCosts(), SLOW, OverlapCosts(issue_ms=0.25, compute_slowdown=0.3)])
def test_no_order_beats_the_overlap_bound(build, overlap):
    b = build()
    dag = b.dag()
    best = min(simulate(dag, order, b.durations, overlap).makespan for order in _all_orders(dag))
    bound = overlap_lower_bound(dag, b.durations, overlap)
    assert bound <= best + 1e-9
    assert bound >= lower_bound(dag, b.durations) - 1e-9


def test_overlap_bound_is_the_old_bound_without_overlap_costs():
    b = _backward_like()
    assert overlap_lower_bound(b.dag(), b.durations) == lower_bound(b.dag(), b.durations)


def _three_gathers(second_needs_mm0: bool):
    """ag0 -> mm0 -> (ag1, side) -> mm1 -> rs: ag1 is issued after mm0 and its wait blocks in the middle."""
    b = DagBuilder()
    x = b.input("x")
    ag0 = b.coll("ag0", 2.0, x, out=100)
    w0 = b.wait("w0", ag0)
    mm0 = b.compute("mm0", 3.0, w0, out=10)
    ag1 = b.coll("ag1", 2.0, mm0 if second_needs_mm0 else x, out=100)
    b.compute("side", 1.0, x, out=0, output=True)
    w1 = b.wait("w1", ag1)
    mm1 = b.compute("mm1", 1.0, mm0, w1, out=10)
    rs = b.coll("rs", 1.0, mm1, op=CollectiveOp.REDUCE_SCATTER, out=5)
    b.wait("w_rs", rs, output=True)
    return b


@pytest.mark.parametrize("second_needs_mm0, limit, why", [
    (False, None, "order_ms"),  # ag1 could have gone right after ag0, and no limit stops it
    (False, 150, "memory_ms"),  # there ag0's 100 B are live: 100 + ag1's 100 B > 150
    (False, 300, "order_ms"),
    (True, None, "dependency_ms"),  # ag1 reads mm0: issued as early as it could be
])
def test_parts_of_a_hand_timeline(second_needs_mm0, limit, why):
    # by hand: ag0 0..2, w0 blocks 2 (first); mm0 2..5; ag1 issued 5, runs 5..7; side 1 ms of work from 5,
    # 1.5x slower while ag1 runs: ends 6.5 (0.5 ms slowdown); w1 blocks 6.5..7 (0.5, middle); mm1 7..8;
    # rs 8..9, w_rs blocks 1 (last).  makespan 9 = compute 5 + slowdown 0.5 + exposed 2 + 0.5 + 1
    b = _three_gathers(second_needs_mm0)
    dag = b.dag()
    tl = simulate(dag, b.order("x", "ag0", "w0", "mm0", "ag1", "side", "w1", "mm1", "rs", "w_rs"), b.durations,
                  SLOW)
    parts = gap_parts(dag, tl, b.durations, SLOW, memory_limit=limit)
    assert parts.makespan_ms == pytest.approx(9.0)
    assert parts.compute_ms == pytest.approx(5.0)
    assert parts.issue_ms == 0.0
    assert parts.slowdown_ms == pytest.approx(0.5)
    assert parts.first_exposed_ms == pytest.approx(2.0)
    assert parts.last_exposed_ms == pytest.approx(1.0)
    assert parts.middle_exposed_ms == pytest.approx(0.5)
    by_cause = {k: getattr(parts, k) for k in ("queued_ms", "dependency_ms", "memory_ms", "order_ms")}
    assert by_cause.pop(why) == pytest.approx(0.5)
    assert all(v == 0.0 for v in by_cause.values())
    # the comm time not exposed (5 - 3.5 = 1.5) must slow compute by at least 1.5 * 0.5 / 1.5
    assert parts.slowdown_floor_ms == pytest.approx(0.5)
    assert parts.bucket_copy_ms == 0.0


def test_queued_collective_and_issue_time():
    # by hand, issue 0.5 ms per collective, no slowdown: ag0 issued 0 (host busy 0..0.5), runs 0.5..2.5;
    # ag1 issued 0.5 (host 0.5..1), queued behind ag0: runs 2.5..4.5; w0 blocks 1..2.5 (first); mm0 2.5..3.5;
    # w1 blocks 3.5..4.5 (middle, queued); mm1 4.5..5.5; ag2 issued 5.5 (host until 6), runs 6..6.5 (last)
    b = DagBuilder()
    ag0 = b.coll("ag0", 2.0)
    ag1 = b.coll("ag1", 2.0)
    w0 = b.wait("w0", ag0)
    mm0 = b.compute("mm0", 1.0, w0)
    w1 = b.wait("w1", ag1)
    b.compute("mm1", 1.0, mm0, w1, output=True)
    b.coll("ag2", 0.5, mm0)  # the group's last, nobody waits: runs 5.5..6, past the compute stream
    overlap = OverlapCosts(issue_ms=0.5)
    dag = b.dag()
    tl = simulate(dag, b.order("ag0", "ag1", "w0", "mm0", "w1", "mm1", "ag2"), b.durations, overlap)
    parts = gap_parts(dag, tl, b.durations, overlap)
    assert parts.makespan_ms == pytest.approx(6.5)
    assert parts.issue_ms == pytest.approx(1.5)
    assert parts.compute_ms == pytest.approx(2.0)
    assert parts.slowdown_ms == pytest.approx(0.0)
    assert parts.first_exposed_ms == pytest.approx(1.5)
    assert parts.queued_ms == pytest.approx(1.0)
    assert parts.last_exposed_ms == pytest.approx(0.5)


def test_bucket_copies_are_counted_apart():
    b = _forward_like()
    dag = b.dag()
    dag.nodes[b.order("mm0")[0]].op = "torch.ops.fsdp_passes.copy_out_members_into.default"
    tl = simulate(dag, b.order("ag0", "ag1", "w0", "mm0", "w1", "mm1"), b.durations)
    assert gap_parts(dag, tl, b.durations).bucket_copy_ms == pytest.approx(3.0)


def test_bad_memory_limit_names_the_option():
    b = _forward_like()
    dag = b.dag()
    tl = simulate(dag, b.order("ag0", "ag1", "w0", "mm0", "w1", "mm1"), b.durations)
    with pytest.raises(ValueError, match="memory_limit"):
        gap_parts(dag, tl, b.durations, memory_limit=-1)
