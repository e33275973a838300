"""The scheduler half of a graph: reorder its DAG within what is left of the memory budget, then report.

The Inductor side (``fsdp_passes.inductor.scheduler_pass``) builds the DAG from scheduler nodes, validates
the order returned here, maps it back onto the nodes and writes the dump.
"""

from __future__ import annotations

import logging
import time

from ..dag.graph import Dag
from ..options import Options
from ..reordering import plan_order
from ..simulate import Timeline, peak_memory
from .report import GraphReport, fill_schedule_numbers

log = logging.getLogger("fsdp_passes")

__all__ = ["finish_graph_report", "plan_graph_order"]


def plan_graph_order(dag: Dag, durations: list[float], options: Options, report: GraphReport,
                     fx_report: GraphReport | None = None) -> list[int]:
    """The order to run ``dag`` in: ``plan_order`` within the memory budget the FX pass of the same graph
    (``fx_report``) left, or the graph order without ``options.reorder``.  Notes what it did in ``report``."""
    identity = list(range(len(dag)))
    if not options.reorder:
        return identity
    baseline_peak = peak_memory(dag, identity)
    budget = options.memory_budget_bytes(baseline_peak, dag.resident_bytes)
    report.extra["memory_budget_total_bytes"] = budget
    # one budget for the whole graph: what the FX pass (bucketing, placement) already added to the peak
    # is not available to reordering any more
    if fx_report is not None and fx_report.fallback is None:
        used = max(0, fx_report.peak_memory_bytes_after - fx_report.peak_memory_bytes_before)
        budget = max(0, budget - used)
        report.extra["memory_budget_used_by_fx_pass"] = used
        if budget == 0 and used > 0:
            report.extra["note"] = ("bucketing used the whole memory_budget: nothing can be prefetched; "
                                    "raise memory_budget to let the reordering prefetch")
            log.info("fsdp_passes %s: %s", report.graph, report.extra["note"])
    report.extra["memory_budget_bytes"] = budget
    result = plan_order(dag, durations, memory_budget_bytes=budget, max_prefetch=options.max_prefetch)
    report.collectives_moved = result.moved
    report.extra["reasons"] = {dag.nodes[i].name: why for i, why in enumerate(result.reasons) if why}
    if result.fallback:
        report.extra["reorder_fallback"] = result.fallback
    return list(result.order)


def finish_graph_report(report: GraphReport, dag: Dag, durations: list[float], order: list[int],
                        start: float) -> tuple[Timeline, Timeline]:
    """Simulate the graph order and ``order`` into ``report`` (pass time counted from ``start``, a
    ``time.perf_counter()`` value) and log it; returns both timelines."""
    identity = list(range(len(dag)))
    timelines = fill_schedule_numbers(report, (dag, identity, durations), (dag, order, durations))
    report.pass_time_s = time.perf_counter() - start
    log.info("fsdp_passes %s", report.one_line())
    return timelines
