"""Reordering Inductor's scheduler nodes: adapter -> DAG -> cost model -> ``pipeline`` (policy within the
memory budget) -> validated order -> report."""

from __future__ import annotations

import time
from typing import Any, Sequence

from torch._inductor.scheduler import BaseSchedulerNode

from ..cost_model import CostModel
from ..dag.gc_pause import collector_paused
from ..debug.dump import write_scheduler_dump
from ..options import Options
from ..pipeline.reorder_graph import finish_graph_report, plan_graph_order
from ..pipeline.report import GraphReport, fill_unchanged_numbers
from .failure_injection import injected
from .gloo_groups import multi_threaded_gloo_groups
from .scheduler_adapter import dag_from_scheduler_nodes

class InvalidOrder(ValueError):
    """A proposed order is not a valid schedule (lost node, broken dependency, changed collective order)."""


@collector_paused()  # as the FX pass (``bucket_graph``): building the DAG and planning create no cycles
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
    start = time.perf_counter()
    try:
        nodes = list(nodes)
    except TypeError:
        raise ValueError(f"reorder_scheduler_nodes: nodes={type(nodes).__name__}; expected a sequence of Inductor "
                         f"scheduler nodes") from None
    for k, node in enumerate(nodes):
        if not isinstance(node, BaseSchedulerNode):
            raise ValueError(f"reorder_scheduler_nodes: nodes[{k}] is of type {type(node).__name__}; expected "
                             f"Inductor scheduler nodes (BaseSchedulerNode)")
    cost_model = cost_model or CostModel.from_options(options.cluster, options.calibration)
    # kernel keys are read only by a calibration's kernel times and by the dump
    dag = dag_from_scheduler_nodes(nodes, kernel_keys=cost_model.calibration is not None or bool(options.debug_dir))
    durations = cost_model.estimate(dag)
    overlap = cost_model.overlap_costs()
    report = GraphReport(graph=graph_name, pass_name="scheduler", options=options.to_json())
    # gloo groups with several worker threads: one collective in flight at a time (benchmarks/gloo_view_race.py)
    serial = multi_threaded_gloo_groups(n.group_name for n in dag.nodes if n.group_name)
    order = plan_graph_order(dag, durations, options, report, fx_report, overlap, one_in_flight_groups=serial)
    if injected("scheduler") == "bad_order":
        order = list(reversed(order))
    problems = dag.order_violations(order)
    if problems:
        raise InvalidOrder(f"graph {graph_name}: proposed order rejected: " + "; ".join(problems[:3]))
    if injected("scheduler") == "exception":
        raise RuntimeError("injected failure in the scheduler pass")
    timelines = finish_graph_report(report, dag, durations, order, start, overlap)
    # always: it also emits the tlparse artifacts and DEBUG move reasons; files only with a debug_dir
    write_scheduler_dump(options.debug_dir, report, dag, durations, list(range(len(dag))), order, timelines,
                         fx_report=fx_report, overlap=overlap)
    return [nodes[i] for i in order], report


def unchanged_schedule_report(nodes: Sequence[Any], options: Options, graph_name: str, reason: str,
                              fx_report: GraphReport | None = None) -> GraphReport:
    """The report (and, with ``options.debug_dir``, the dump) of a graph whose input order was kept because
    the pass fell back: the unchanged schedule, its simulation and ``reason``.  ``fx_report``: what the FX
    pass did to the same graph (folded into the dump).  Never raises."""
    report = GraphReport(graph=graph_name, pass_name="scheduler", options=options.to_json(), fallback=reason)
    simulated = fill_unchanged_numbers(report, lambda: dag_from_scheduler_nodes(list(nodes)), options)
    if simulated is not None:
        dag, durations, overlap, timelines = simulated
        identity = list(range(len(dag)))
        write_scheduler_dump(options.debug_dir, report, dag, durations, identity, identity, timelines,
                             fx_report=fx_report, overlap=overlap)
    return report  # not logged again: run_guarded already said why the pass fell back
