"""Per-graph debug dumps, structured-trace artifacts and DEBUG logs of the passes.

``Options.debug_dir`` (or ``FSDP_PASSES_DEBUG_DIR``) makes every compiled graph write a folder
``<debug_dir>/<graph>/`` (``<debug_dir>/rank<k>/<graph>/`` on ranks other than 0), where ``<graph>`` is the
report's name (``000_fwd_frame0.0``: compile order first, so folders sort in compile order):

========================  ===================================================================================
``schedule_before.txt``   the order the scheduler pass received, one row per node (see ``tables``)
``schedule_after.txt``    the order it returned, with each node's position before the pass
``buckets.json``          the buckets the FX pass built (``[]`` when it built none / did not run)
``dag.json``              the DAG, both orders, the durations and overlap costs, losslessly (``dag_json``)
``dag.dot``               the DAG for Graphviz
``trace.json``            Chrome / Perfetto trace, processes "before" and "after"
``summary.json``          the numbers of the graph (``GraphReport.to_json`` and more)
``timeline.png``          both timelines, if matplotlib is installed (else ``summary.json``'s
                          ``skipped_files`` says why, and one INFO line is logged)
========================  ===================================================================================

A pass that falls back writes the same files for the graph as it was left (``schedule_after.txt`` equals
``schedule_before.txt``), with ``summary.json``'s ``fallback`` giving the reason; ``report`` marks it.
``dag.json``'s ``meta`` records the cluster profile and the world size the dump was priced with.

Writing a dump never breaks a compile: a failure is a warning.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, Callable, Sequence

from ..dag.graph import Dag
from ..pipeline.report import GraphReport
from ..simulate import OverlapCosts, Timeline, chrome_trace, simulate
from .dag_json import dag_to_json
from .warn import warn_and_log
from .plot import can_plot, matplotlib_missing_note
from .tables import schedule_table

log = logging.getLogger("fsdp_passes")

SUMMARY_KEYS = (
    "graph",
    "n_collectives_before",
    "n_collectives_after",
    "exposed_comm_ms_before",
    "exposed_comm_ms_after",
    "makespan_ms_before",
    "makespan_ms_after",
    "lower_bound_ms",
    "peak_memory_bytes_before",
    "peak_memory_bytes_after",
    "pass_time_s",
    "collective_fingerprint",
    "options",
)
DUMP_FILES = ("schedule_before.txt", "schedule_after.txt", "buckets.json", "dag.json", "dag.dot", "trace.json",
              "summary.json")


def graph_dir(debug_dir: str | os.PathLike[str], graph: str) -> str:
    """``<debug_dir>/<graph>`` on rank 0 (or without distributed), ``<debug_dir>/rank<k>/<graph>`` elsewhere."""
    rank = _rank()
    base = os.fspath(debug_dir) if rank == 0 else os.path.join(os.fspath(debug_dir), f"rank{rank}")
    return os.path.join(base, _safe_name(graph))


def _world_size(dag: Dag) -> int | None:
    """The job's world size (or, without distributed, the largest process group of the graph)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except Exception:  # no distributed: from the graph
        pass
    from .whatif import world_size_of

    return world_size_of(dag)


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # no distributed: rank 0
        pass
    return 0


def _safe_name(graph: str) -> str:
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(graph)) or "graph"
    return name.lstrip(".") or "graph"


def _write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_json(path: str, data: Any) -> None:
    _write_text(path, json.dumps(data, indent=1, default=str) + "\n")


def _buckets_of(report: GraphReport | None) -> list[Any]:
    if report is None or report.fallback:
        return []
    buckets = report.extra.get("buckets")
    if buckets is None:  # bucket_graph's report keeps them under extra["bucketing"]["buckets"]
        buckets = (report.extra.get("bucketing") or {}).get("buckets")
    return list(buckets or [])


# -- FX pass --------------------------------------------------------------------------------------------------


def write_bucketing_dump(debug_dir: str | os.PathLike[str] | None, report: GraphReport) -> str | None:
    """With a ``debug_dir``, write the ``buckets.json`` of the FX pass ``report`` of a graph.

    ``buckets.json`` is the list ``report.extra["buckets"]`` (one dict per bucket: members, op, group, dtype,
    bytes, estimated_ms, close_reason), ``[]`` when the pass built none.  Returns the file written, if any.
    """
    if not debug_dir:
        return None
    try:
        folder = graph_dir(debug_dir, report.graph)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "buckets.json")
        _write_json(path, _buckets_of(report))
        return path
    except Exception as exc:  # a dump must never break the compile
        _dump_failed(report.graph, exc)
        return None


# -- scheduler pass -------------------------------------------------------------------------------------------


def build_summary(report: GraphReport, timelines: tuple[Timeline, Timeline] | None = None, dag: Dag | None = None,
                  fx_report: GraphReport | None = None) -> dict:
    """summary.json: ``report.to_json()`` with ``fx_report``, the FX pass of the same graph, folded in.

    ``n_collectives_before`` counts collectives before bucketing when the FX pass bucketed this graph
    (``n_collectives_before_scheduler`` keeps the count the scheduler pass received); ``pass_time_s`` is
    the time of both passes on this graph.
    """
    summary = report.to_json()
    summary["n_collectives_before_scheduler"] = report.n_collectives_before
    summary["scheduler_pass_time_s"] = report.pass_time_s
    fx = fx_report
    if fx is not None:
        fx_json = fx.to_json()
        fx_json.pop("extra", None)
        fx_json.pop("options", None)
        summary["fx"] = fx_json
        summary["fx_pass_time_s"] = fx.pass_time_s
        summary["pass_time_s"] = report.pass_time_s + fx.pass_time_s
        if not fx.fallback and fx.n_collectives_before:
            summary["n_collectives_before"] = fx.n_collectives_before
        summary["n_buckets"] = len(_buckets_of(fx))
        bucketing = fx.extra.get("bucketing")
        if isinstance(bucketing, dict):  # why the other collectives stayed alone, unmatched plan entries...
            summary["bucketing"] = {k: v for k, v in bucketing.items() if k != "buckets"}
    else:
        summary["fx"] = None
        summary["fx_pass_time_s"] = 0.0
        summary["n_buckets"] = 0
    if dag is not None:
        summary["n_nodes"] = len(dag)
    if timelines is not None:
        tb, ta = timelines
        summary["comm_ms_before"] = dict(tb.comm_time)
        summary["comm_ms_after"] = dict(ta.comm_time)
        summary["compute_busy_ms"] = ta.compute_busy
    return summary


def move_reasons(report: GraphReport, dag: Dag, before: Sequence[int], after: Sequence[int]) -> list[str]:
    """One line per node the pass moved: its name, positions and the planner's reason."""
    reasons = report.extra.get("reasons") or {}
    pos_before = {i: p for p, i in enumerate(before)}
    lines = []
    for p, i in enumerate(after):
        name = dag.nodes[i].name
        if pos_before.get(i) != p or name in reasons:
            why = reasons.get(name, "moved by its dependencies")
            lines.append(f"{report.graph}: {name} {pos_before.get(i)} -> {p}: {why}")
    return lines


def log_move_reasons(report: GraphReport, dag: Dag, before: Sequence[int], after: Sequence[int]) -> None:
    """DEBUG log, once per report: why each node moved (``report.extra["reasons"]``)."""
    if report.reasons_logged or not log.isEnabledFor(logging.DEBUG):
        return
    report.reasons_logged = True
    for line in move_reasons(report, dag, before, after):
        log.debug("fsdp_passes moved %s", line)


def emit_artifacts(summary: dict | Callable[[], dict], schedule_before: str | Callable[[], str],
                   schedule_after: str | Callable[[], str], graph: str | None = None) -> None:
    """Structured-trace (tlparse) artifacts ``fsdp_passes_<graph>_{summary,schedule_before,schedule_after}``.
    The summary and the schedules may be given as functions that make them: called only when structured
    tracing is on (``graph`` then names the graph; else the summary's ``graph``)."""
    try:
        from torch._logging import trace_structured
    except ImportError:  # pragma: no cover - torch without structured logging
        return
    if graph is None:
        graph = (summary() if callable(summary) else summary).get("graph", "graph")

    def text(schedule: Any) -> Callable[[], Any]:
        return schedule if callable(schedule) else lambda: schedule

    summary_of = text(summary)
    items = (
        ("summary", "json", lambda: json.dumps(summary_of(), default=str)),
        ("schedule_before", "string", text(schedule_before)),
        ("schedule_after", "string", text(schedule_after)),
    )
    for what, encoding, payload in items:
        trace_structured(
            "artifact",
            metadata_fn=lambda what=what, encoding=encoding: {"name": f"fsdp_passes_{graph}_{what}",
                                                              "encoding": encoding},
            payload_fn=payload,
            expect_trace_id=False,
        )


def write_scheduler_dump(
    debug_dir: str | os.PathLike[str] | None,
    report: GraphReport,
    dag: Dag,
    durations: Sequence[float],
    before_order: Sequence[int],
    after_order: Sequence[int],
    timelines: tuple[Timeline, Timeline] | None = None,
    fx_report: GraphReport | None = None,
    overlap: OverlapCosts | None = None,
) -> str | None:
    """Write the dump folder of one graph (see the module docstring), emit the structured-trace artifacts
    and DEBUG-log the move reasons.  ``timelines`` are (before, after) ``simulate`` results of the two
    orders (simulated here when None, with ``overlap``: what overlapping costs, also written to ``dag.json``);
    ``fx_report`` is the FX pass report of the same graph.  Returns the folder, or None without
    ``debug_dir`` or on failure (which is a warning, never an exception).
    """
    try:
        log_move_reasons(report, dag, before_order, after_order)
        if timelines is None:
            timelines = (simulate(dag, before_order, durations, overlap),
                         simulate(dag, after_order, durations, overlap))
        tb, ta = timelines

        @functools.cache
        def summary() -> dict:
            made = build_summary(report, timelines, dag, fx_report)
            if debug_dir and not can_plot():  # before the artifacts, so they carry it as summary.json does
                made["skipped_files"] = {"timeline.png": matplotlib_missing_note()}
            return made

        # the summary and tables are made only for a reader: the dump folder, or structured tracing (tlparse)
        before_txt = functools.cache(lambda: schedule_table(
            dag, before_order, durations, tb, title=f"graph {report.graph}: schedule before the pass"))
        after_txt = functools.cache(lambda: schedule_table(
            dag, after_order, durations, ta, was=before_order,
            title=f"graph {report.graph}: schedule after the pass (was: position before the pass)"))
        emit_artifacts(summary, before_txt, after_txt, graph=report.graph)
        if not debug_dir:
            return None
        summary = summary()
        folder = graph_dir(debug_dir, report.graph)
        os.makedirs(folder, exist_ok=True)
        files = list(DUMP_FILES)
        _write_text(os.path.join(folder, "schedule_before.txt"), before_txt())
        _write_text(os.path.join(folder, "schedule_after.txt"), after_txt())
        _write_json(os.path.join(folder, "buckets.json"), _buckets_of(fx_report))
        # what the dump was priced with: ``simulate`` re-uses both unless told otherwise
        meta = {"cluster": report.options.get("cluster"), "world_size": _world_size(dag), "options": report.options}
        _write_text(
            os.path.join(folder, "dag.json"),
            json.dumps(dag_to_json(dag, before_order, after_order, durations, graph=report.graph, meta=meta,
                                   overlap=overlap),
                       default=str) + "\n",
        )
        _write_text(os.path.join(folder, "dag.dot"), dag.to_dot(report.graph))
        trace = chrome_trace({"before": (dag, tb), "after": (dag, ta)})
        _write_text(os.path.join(folder, "trace.json"), json.dumps(trace) + "\n")
        from .plot import write_timeline_png

        png = os.path.join(folder, "timeline.png")
        if write_timeline_png(png, dag, {"before": tb, "after": ta}, title=report.graph):
            files.append("timeline.png")
        elif os.path.exists(png):
            os.remove(png)  # stale, from an earlier run with matplotlib
        summary["files"] = files
        _write_json(os.path.join(folder, "summary.json"), summary)
        log.debug("fsdp_passes %s: dump written to %s", report.graph, folder)
        return folder
    except Exception as exc:  # a dump must never break the compile
        _dump_failed(report.graph, exc)
        return None


def _dump_failed(graph: str, exc: BaseException) -> None:
    message = f"fsdp_passes: could not write the debug dump of graph {graph}: {type(exc).__name__}: {exc}"
    warn_and_log(message, RuntimeWarning, stacklevel=3)
