"""Running the bucketing rewrite inside Inductor's post-grad pass slot, safely.

The rewrite mutates the graph in place; if anything fails half-way the graph is restored, so the user's compile
goes on with the graph exactly as Inductor built it: from a record of its nodes taken right before the first merge
(rebuilt as new nodes), or, when
nothing was merged (the pass only moved nodes, or failed before changing anything), by putting the nodes back in
their original order.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.fx as fx

from ..bucketing.placement import restore_order
from ..dag.from_fx import dag_from_fx
from ..debug.dump import write_bucketing_dump
from ..options import Options
from ..pipeline import bucket_graph
from ..pipeline.report import GraphReport, fill_unchanged_numbers
from .failure_injection import injected
from .guard import run_guarded
from .shard_shapes import warn_if_uneven_shards

log = logging.getLogger("fsdp_passes")


#: one node as the pass found it: the node, op, target, args, kwargs, type, name and a copy of its meta
_NodeRecord = tuple[fx.Node, str, Any, tuple, dict, Any, str, dict]


def _snapshot(graph: fx.Graph) -> list[_NodeRecord]:
    """What restoring ``graph`` needs, without copying it: FX never mutates a node's ``args`` / ``kwargs`` in
    place (a change, or an erase, puts new ones on the node), so the ones held here stay as they were; ``meta``
    is copied one level deep, as ``Graph.graph_copy`` copies it."""
    return [(n, n.op, n.target, n.args, n.kwargs, n.type, n.name, dict(n.meta)) for n in graph.nodes]


def _restore(graph: fx.Graph, snapshot: list[_NodeRecord]) -> None:
    """Rebuild ``graph``'s nodes from ``snapshot`` (new nodes: a name still taken gets a suffix)."""
    for node in reversed(list(graph.nodes)):
        graph.erase_node(node)
    new_of: dict[fx.Node, fx.Node] = {}
    # a failed rewrite may have left the insertion point on an erased node: append at the end again
    # (``inserting_after(None)`` inserts at the end of the graph)
    with graph.inserting_after(None):
        for old, op, target, args, kwargs, type_expr, name, meta in snapshot:
            node = graph.create_node(op, target, fx.node.map_arg(args, new_of.__getitem__),
                                     fx.node.map_arg(kwargs, new_of.__getitem__), name=name, type_expr=type_expr)
            node.meta = dict(meta)
            new_of[old] = node


def run_fx_pass(graph: fx.Graph, options: Options, graph_name: str) -> GraphReport:
    """Bucket ``graph`` in place per ``options``; on failure warn and leave it unchanged (raise if strict).
    Returns the pass's report (with ``fallback`` set when the graph was left unchanged)."""
    warn_if_uneven_shards(graph)
    order = list(graph.nodes)
    snapshot: list[list[_NodeRecord]] = []  # the graph's nodes as they were before the first merge, if any
    start = time.perf_counter()

    def attempt() -> GraphReport:
        if injected("fx") == "exception":
            # mutate first, so the test also proves the graph is restored
            first = next(n for n in graph.nodes if n.op != "placeholder")
            graph.inserting_before(first)
            raise RuntimeError("injected failure in the fx pass")
        result = bucket_graph(graph, options, graph_name=graph_name,
                              before_merging=lambda: snapshot.append(_snapshot(graph)))
        if result.rewrite is not None and result.rewrite.gathers_ahead_of_reductions:
            # moved nodes are checked here, inside the guard, so a bad move falls back instead of failing the
            # compile (a merge is checked by ``apply_buckets`` itself; an untouched graph needs no check)
            graph.lint()
        report = result.report
        report.pass_time_s = time.perf_counter() - start
        log.info("fsdp_passes %s", report.one_line())
        return report

    def fallback(reason: str) -> GraphReport:
        if snapshot:
            _restore(graph, snapshot[0])
        else:
            restore_order(order)
        report = GraphReport(graph=graph_name, pass_name="fx", fallback=reason, options=options.to_json())
        fill_unchanged_numbers(report, lambda: dag_from_fx(graph), options)
        return report

    report = run_guarded("fx", options, attempt, lambda reason: fallback(f"pass failed, graph left unchanged: {reason}"),
                         lambda reason: fallback(f"left untouched: {reason}"))
    write_bucketing_dump(options.debug_dir, report)
    return report


__all__ = ["run_fx_pass"]
