"""Reordering Inductor's scheduler nodes: adapter -> DAG -> cost model -> policy -> validated order."""

from __future__ import annotations

import logging
import time
from typing import Sequence

from torch._inductor.scheduler import BaseSchedulerNode

from ..cost_model import CostModel
from ..options import Options
from ..pipeline.report import GraphReport, fill_schedule_numbers
from .failure_injection import injected
from .scheduler_adapter import dag_from_scheduler_nodes

log = logging.getLogger("fsdp_passes")


class InvalidOrder(ValueError):
    """A proposed order is not a valid schedule (lost node, broken dependency, changed collective order)."""


def reorder_scheduler_nodes(
    nodes: Sequence[BaseSchedulerNode], options: Options, graph_name: str = "graph",
    cost_model: CostModel | None = None, fx_report: GraphReport | None = None,
) -> tuple[list[BaseSchedulerNode], GraphReport]:
    """Plan an overlap-friendly order of ``nodes`` (Inductor scheduler nodes) and return it with its report.

    Runs directly on a captured node list (``fsdp_passes.testing.capture_scheduler_nodes``), so a unit test
    can try several option sets on one capture.  The returned order has been validated: same nodes, every
    dependency respected, every process group's collectives in their original order.  Raises
    ``InvalidOrder`` if the policy proposed anything else (the installed pass then keeps the input order).
    ``fx_report``: what the FX pass did to the same graph; what it added to the peak is taken off the
    memory budget, and the dump folds it in.
    """
    from ..reordering import plan_order
    from ..simulate import peak_memory

    start = time.perf_counter()
    nodes = list(nodes)
    dag = dag_from_scheduler_nodes(nodes)
    cost_model = cost_model or CostModel.from_options(options.cluster, options.calibration)
    durations = cost_model.estimate(dag)
    identity = list(range(len(nodes)))
    report = GraphReport(graph=graph_name, pass_name="scheduler", options=options.to_json())
    if options.reorder:
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
                log.info("fsdp_passes %s: %s", graph_name, report.extra["note"])
        report.extra["memory_budget_bytes"] = budget
        result = plan_order(dag, durations, memory_budget_bytes=budget, max_prefetch=options.max_prefetch)
        order = list(result.order)
        report.collectives_moved = result.moved
        report.extra["reasons"] = {dag.nodes[i].name: why for i, why in enumerate(result.reasons) if why}
        if result.fallback:
            report.extra["reorder_fallback"] = result.fallback
    else:
        order = identity
    if injected("scheduler") == "bad_order":
        order = list(reversed(order))
    problems = dag.order_violations(order)
    if problems:
        raise InvalidOrder(f"graph {graph_name}: proposed order rejected: " + "; ".join(problems[:3]))
    if injected("scheduler") == "exception":
        raise RuntimeError("injected failure in the scheduler pass")
    timelines = fill_schedule_numbers(report, (dag, identity, durations), (dag, order, durations))
    report.pass_time_s = time.perf_counter() - start
    log.info("fsdp_passes %s", report.one_line())
    from ..debug import write_scheduler_dump

    # always: it also emits the tlparse artifacts and DEBUG move reasons; files only with a debug_dir
    write_scheduler_dump(options.debug_dir, report, dag, durations, identity, order, timelines, fx_report=fx_report)
    return [nodes[i] for i in order], report
