"""The scheduler half of a graph: reorder its DAG within what is left of the memory budget, then report.

The Inductor side (``fsdp_passes.inductor.scheduler_pass``) builds the DAG from scheduler nodes, validates
the order returned here, maps it back onto the nodes and writes the dump.
"""

from __future__ import annotations

import logging
import time

from typing import Mapping

from ..dag.graph import Dag
from ..options import Options
from ..reordering import plan_order
from ..reordering.one_in_flight import max_in_flight, one_in_flight
from ..simulate import OverlapCosts, Timeline
from .report import GraphBudget, GraphReport, fill_schedule_numbers

log = logging.getLogger("fsdp_passes")

__all__ = ["finish_graph_report", "plan_graph_order"]


def plan_graph_order(dag: Dag, durations: list[float], options: Options, report: GraphReport,
                     fx_report: GraphReport | None = None, overlap: OverlapCosts | None = None,
                     one_in_flight_groups: Mapping[str, int] | None = None) -> list[int]:
    """The order to run ``dag`` in: ``plan_order`` within the memory budget the FX pass of the same graph
    (``fx_report.budget``) left, or the graph order without ``options.reorder``.  Notes what it did in ``report``; without an FX report the budget is
    taken of this DAG as the FX pass does (``budget.graph_memory_budget``).  ``overlap``: what overlapping
    costs (``CostModel.overlap_costs``), for the plan as for the report.

    ``one_in_flight_groups``: ``{group name: gloo worker threads}`` of the groups that must never have two
    collectives in flight (gloo with several threads: ``reordering.one_in_flight``); the plan is made with
    ``max_prefetch=1`` and the order returned holds at most one in flight per such group, whatever the plan did.
    """
    order = _plan(dag, durations, options, report, fx_report, overlap, bool(one_in_flight_groups))
    serial = sorted(set(one_in_flight_groups or ()) & set(dag.group_sequences()))
    if serial:
        order, waits_moved = one_in_flight(dag, order, serial)
        report.extra["one_in_flight_groups"] = {g: one_in_flight_groups[g] for g in serial}
        report.extra["waits_moved_for_one_in_flight"] = waits_moved
        report.extra["max_in_flight"] = max_in_flight(dag, order)
    return order


def _plan(dag: Dag, durations: list[float], options: Options, report: GraphReport, fx_report: GraphReport | None,
          overlap: OverlapCosts | None, one_in_flight_cap: bool) -> list[int]:
    identity = list(range(len(dag)))
    # one budget per graph, kept end to end: the FX pass took its claim (bucketing, gather placement: a
    # bound from payloads) out of it; reordering gets the rest over the order Inductor built
    if fx_report is not None and fx_report.fallback is None and fx_report.budget is not None:
        report.budget = fx_report.budget
    else:
        from .budget import graph_memory_budget

        report.budget = GraphBudget(graph_memory_budget(dag, options).total, 0)
    budget = report.budget.reorder_budget_bytes
    report.extra["reorder_budget_bytes"] = budget
    if not options.reorder:
        return identity
    if budget == 0 and report.budget.memory_budget_used_bytes > 0:
        report.extra["note"] = ("bucketing used the whole memory_budget: nothing can be prefetched; "
                                "raise memory_budget to let the reordering prefetch")
        log.info("fsdp_passes %s: %s", report.graph, report.extra["note"])
    max_prefetch = 1 if one_in_flight_cap else options.max_prefetch
    result = plan_order(dag, durations, memory_budget_bytes=budget, max_prefetch=max_prefetch, overlap=overlap)
    report.collectives_moved = result.moved
    report.extra["reasons"] = {dag.nodes[i].name: why for i, why in enumerate(result.reasons) if why}
    if result.regrouped:
        report.extra["kernel_groups_made_whole"] = result.regrouped
    if result.fallback:
        report.extra["reorder_fallback"] = result.fallback
    return list(result.order)


def finish_graph_report(report: GraphReport, dag: Dag, durations: list[float], order: list[int],
                        start: float, overlap: OverlapCosts | None = None) -> tuple[Timeline, Timeline]:
    """Simulate the graph order and ``order`` into ``report`` (pass time counted from ``start``, a
    ``time.perf_counter()`` value) and log it; returns both timelines."""
    identity = list(range(len(dag)))
    timelines = fill_schedule_numbers(report, (dag, identity, durations), (dag, order, durations), overlap)
    if report.budget is not None:
        # peak_memory_bytes_before is Inductor's order of the graph it was given (without bucketing: the
        # no-pass peak); the final order keeps within it plus what the FX pass left of the budget
        report.extra["memory_limit_bytes"] = report.peak_memory_bytes_before + report.budget.reorder_budget_bytes
    report.pass_time_s = time.perf_counter() - start
    log.info("fsdp_passes %s", report.one_line())
    return timelines
