"""Overlap costs in the simulator (host issue time, compute slowed while a collective runs) against timelines
computed by hand, and the profile terms the cost model hands to it."""

from __future__ import annotations

import pytest

from fsdp_passes.cost_model import CostModel, load_profile
from fsdp_passes.simulate import OverlapCosts, simulate
from fsdp_passes.testing import DagBuilder


def _graph(c0_ms: float):
    b = DagBuilder()
    b.compute("c0", c0_ms)
    ag = b.coll("ag", 3)
    w = b.wait("w", ag)
    b.compute("c1", 2, w, 0)
    return b, ag, w


def test_without_overlap_costs_the_timeline_is_unchanged():
    b, ag, w = _graph(2)
    order = b.order("ag", "c0", "w", "c1")
    free = simulate(b.dag(), order, b.durations)
    zero = simulate(b.dag(), order, b.durations, overlap=OverlapCosts())
    assert free.makespan == zero.makespan == pytest.approx(5.0)
    assert free.end == zero.end


def test_compute_slowed_for_the_whole_node_while_the_collective_runs():
    # by hand: issuing ag holds the compute stream 0.5 ms -> ag runs 0.5..3.5; c0 (2 ms of work) runs 1.5x
    # slower: 3 ms of wall time, 0.5..3.5, still inside ag; the wait blocks 0; c1 runs 3.5..5.5 at full speed
    b, ag, w = _graph(2)
    tl = simulate(b.dag(), b.order("ag", "c0", "w", "c1"), b.durations,
                  overlap=OverlapCosts(issue_ms=0.5, compute_slowdown=0.5))
    c0, c1 = b.order("c0", "c1")
    assert (tl.start[ag], tl.end[ag]) == (pytest.approx(0.5), pytest.approx(3.5))
    assert tl.end[c0] == pytest.approx(3.5)
    assert tl.wait_blocked[w] == pytest.approx(0.0)
    assert tl.end[c1] == pytest.approx(5.5)
    assert tl.makespan == pytest.approx(5.5)
    assert tl.compute_busy == pytest.approx(0.5 + 3.0 + 2.0)


def test_compute_slowed_only_while_the_collective_runs():
    # by hand: c0 has 3 ms of work from t=0.5; until ag ends at 3.5 it progresses 3.0/1.5 = 2 ms, the last
    # 1 ms runs at full speed: c0 ends at 4.5; c1 4.5..6.5
    b, ag, w = _graph(3)
    tl = simulate(b.dag(), b.order("ag", "c0", "w", "c1"), b.durations,
                  overlap=OverlapCosts(issue_ms=0.5, compute_slowdown=0.5))
    c0, c1 = b.order("c0", "c1")
    assert tl.end[c0] == pytest.approx(4.5)
    assert tl.end[c1] == pytest.approx(6.5)
    assert tl.exposed_total == pytest.approx(0.0)


def test_issue_time_delays_a_collective_issued_after_compute():
    # by hand: c0 0..2, issuing ag 2..2.5, ag 2.5..5.5, the wait blocks 2.5..5.5, c1 5.5..7.5
    b, ag, w = _graph(2)
    tl = simulate(b.dag(), b.order("c0", "ag", "w", "c1"), b.durations, overlap=OverlapCosts(issue_ms=0.5))
    assert tl.start[ag] == pytest.approx(2.5)
    assert tl.wait_blocked[w] == pytest.approx(3.0)
    assert tl.makespan == pytest.approx(7.5)


def test_overlap_costs_bad_values():
    with pytest.raises(ValueError, match="compute_slowdown"):
        OverlapCosts(compute_slowdown=-0.1)
    with pytest.raises(ValueError, match="issue_ms"):
        OverlapCosts(issue_ms=float("nan"))
    b, _, _ = _graph(2)
    with pytest.raises(ValueError, match="overlap"):
        simulate(b.dag(), b.order("ag", "c0", "w", "c1"), b.durations, overlap=0.5)


def test_cost_model_hands_the_profile_terms_to_the_simulator():
    gloo = CostModel(load_profile("cpu-gloo")).overlap_costs()
    assert gloo == OverlapCosts(issue_ms=0.14, compute_slowdown=0.9)  # measured: benchmarks/overlap_costs.py
    h100 = load_profile("h100-nvlink")
    # the GPU default is derived in the profile's description: 3 x ring busbw / HBM bandwidth
    assert h100.compute_slowdown_during_comm == pytest.approx(3 * 360 / 3350, abs=0.01)
    assert CostModel(h100).overlap_costs().issue_ms == pytest.approx(h100.kernel_launch_us / 1e3)
    with pytest.raises(ValueError, match="compute_slowdown_during_comm"):
        load_profile({"base": "h100-nvlink", "compute_slowdown_during_comm": -1})
    with pytest.raises(ValueError, match="collective_library"):
        load_profile({"base": "h100-nvlink", "collective_library": "mpi"})
