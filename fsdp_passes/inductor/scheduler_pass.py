"""Reordering Inductor's scheduler nodes: adapter -> DAG -> cost model -> policy -> validated order."""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from ..options import Options
from ..report import GraphReport, fill_schedule_numbers, find_report, record
from .hooks import injected
from .scheduler_adapter import dag_from_scheduler_nodes

log = logging.getLogger("fsdp_passes")


class InvalidOrder(ValueError):
    """A proposed order is not a valid schedule (lost node, broken dependency, changed collective order)."""


def reorder_scheduler_nodes(
    nodes: Sequence[Any], options: Options, graph_name: str = "graph", cost_model: Any = None
) -> tuple[list[Any], GraphReport]:
    """Plan an overlap-friendly order of ``nodes`` (Inductor scheduler nodes) and return it with its report.

    Runs directly on a captured node list (``fsdp_passes.testing.capture_scheduler_nodes``), so a unit test
    can try several option sets on one capture.  The returned order has been validated: same nodes, every
    dependency respected, every process group's collectives in their original order.  Raises
    ``InvalidOrder`` if the policy proposed anything else (the installed pass then keeps the input order).
    """
    from ..cost_model import CostModel
    from ..reordering import plan_order

    start = time.perf_counter()
    nodes = list(nodes)
    dag = dag_from_scheduler_nodes(nodes)
    cost_model = cost_model or CostModel.from_options(options.cluster, options.calibration)
    durations = cost_model.estimate(dag)
    identity = list(range(len(nodes)))
    report = GraphReport(graph=graph_name, pass_name="scheduler", options=options.to_json())
    # one budget per graph, kept end to end: the FX pass took its claim (bucketing, gather placement: a
    # bound from payloads) out of it; reordering gets the rest over the order Inductor built
    fx_report = find_report(graph_name, "fx")
    if fx_report is not None and fx_report.fallback is None and "memory_budget_bytes" in fx_report.extra:
        total = int(fx_report.extra["memory_budget_bytes"])
        used = int(fx_report.extra["memory_budget_used_bytes"])
    else:
        from ..bucketing.plan import fsdp_payload_bytes

        total, used = options.memory_budget_bytes(fsdp_payload_bytes(dag)), 0
    budget = max(0, total - used)
    report.extra["memory_budget_total_bytes"] = total
    report.extra["memory_budget_used_by_fx_pass"] = used
    report.extra["memory_budget_bytes"] = budget
    if options.reorder:
        if budget == 0 and used > 0:
            report.extra["note"] = ("bucketing used the whole memory_budget: nothing can be prefetched; "
                                    "raise memory_budget to let the reordering prefetch")
            log.info("fsdp_passes %s: %s", graph_name, report.extra["note"])
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
    # peak_memory_bytes_before is Inductor's order of the graph it was given (without bucketing: the no-pass
    # peak); the final order keeps within it plus what the FX pass left of the budget
    report.extra["memory_limit_bytes"] = report.peak_memory_bytes_before + budget
    report.pass_time_s = time.perf_counter() - start
    record(report)
    log.info("fsdp_passes %s", report.one_line())
    from ..debug import write_scheduler_dump

    # always: it also emits the tlparse artifacts and DEBUG move reasons; files only with a debug_dir
    write_scheduler_dump(options.debug_dir, report, dag, durations, identity, order, timelines)
    return [nodes[i] for i in order], report
