"""``dag.json``: a lossless JSON form of a DAG with the two orders and the per-node durations of a dump.

Format (``"format": "fsdp_passes.dag"``, ``"version": 1``)::

    {
      "format": "fsdp_passes.dag", "version": 1,
      "graph": "000_fwd_frame0.0",
      "nodes": [{"name": ..., "kind": "compute" | "collective" | "wait", "op": ..., "collective": null |
                 "all_gather" | ..., "group_name": ..., "group_size": ..., "group_ranks": [..] | null,
                 "reduce_op": ..., "comm_bytes": ..., "in_bytes": ..., "out_bytes": ..., "dtype": ...,
                 "flops": ..., "alias_of": ..., "collective_of": ..., "is_output": ..., "fsdp": ...,
                 "module_fqn": ..., "param_fqn": ..., "kernel_key": ..., "launches_kernel": ...,
                 "input_reads": {name: bytes}, "non_owning_bytes": ..., "graph_output_bytes": ...,
                 "output_buffers": [{"nbytes": ..., "readers": [node name, ...], "graph_output": ...,
                                     "allocated": ...}, ...]},
                ...],                                               # every DagNode field except origin
      "edges": [[src, dst], ...],                                   # node ids, Dag.edges() order
      "orders": {"before": [...], "after": [...]},                  # node ids, as run on the compute stream
      "durations_ms": [...],                                        # estimated ms per node id
      "overlap": {"issue_ms": ..., "compute_slowdown": ...} | null,  # what overlapping cost (OverlapCosts)
      "meta": {...}                                                 # free-form (cluster, options, ...)
    }

Node ids are positions in ``nodes``.  Floats are written with Python's shortest round-trip repr, so
loading gives back exactly the numbers that were dumped.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..dag.graph import CollectiveOp, Dag, DagNode, NodeKind, OutputBuffer
from ..simulate.timeline import OverlapCosts

FORMAT = "fsdp_passes.dag"
VERSION = 1

_NODE_FIELDS = tuple(f.name for f in dataclasses.fields(DagNode) if f.name != "origin")


class DagJsonError(ValueError):
    """A dag.json document that cannot be read back (wrong format, missing or malformed fields)."""


@dataclass
class DagDump:
    """What ``dag.json`` holds: the DAG, both orders, the durations, what overlapping cost when it was priced
    (``simulate(dump.dag, dump.after, dump.durations, dump.overlap)`` gives the dumped figures) and free-form
    metadata."""

    dag: Dag
    before: list[int]
    after: list[int]
    durations: list[float]
    graph: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    overlap: OverlapCosts | None = None


def node_to_json(node: DagNode) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _NODE_FIELDS:
        value = getattr(node, name)
        if isinstance(value, (NodeKind, CollectiveOp)):
            value = value.value
        elif name == "output_buffers":
            value = [{"nbytes": b.nbytes, "readers": list(b.readers), "graph_output": b.graph_output,
                      "allocated": b.allocated} for b in value]
        elif isinstance(value, tuple):
            value = list(value)
        out[name] = value
    return out


def node_from_json(data: Mapping[str, Any], where: str = "node") -> DagNode:
    if not isinstance(data, Mapping):
        raise DagJsonError(f"{where}: expected an object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_NODE_FIELDS))
    if unknown:
        raise DagJsonError(f"{where}: unknown field(s) {', '.join(unknown)}")
    if "name" not in data or "kind" not in data:
        raise DagJsonError(f"{where}: 'name' and 'kind' are required")
    values = dict(data)
    try:
        values["kind"] = NodeKind(values["kind"])
        if values.get("collective") is not None:
            values["collective"] = CollectiveOp(values["collective"])
    except ValueError as exc:
        raise DagJsonError(f"{where}: {exc}") from None
    if values.get("group_ranks") is not None:
        values["group_ranks"] = tuple(values["group_ranks"])
    try:
        values["output_buffers"] = tuple(OutputBuffer(int(b["nbytes"]), tuple(b.get("readers", ())),
                                                      bool(b.get("graph_output", False)), bool(b.get("allocated", True)))
                                         for b in values.get("output_buffers", ()))
    except (TypeError, KeyError) as exc:
        raise DagJsonError(f"{where}: output_buffers must be a list of {{nbytes, readers, graph_output, allocated}}: {exc}") from None
    return DagNode(**values)


def dag_to_json(
    dag: Dag,
    before: Sequence[int] | None = None,
    after: Sequence[int] | None = None,
    durations: Sequence[float] | None = None,
    graph: str = "",
    meta: Mapping[str, Any] | None = None,
    overlap: OverlapCosts | None = None,
) -> dict[str, Any]:
    """The ``dag.json`` document of ``dag`` (orders default to the node order, durations to zeros, overlap to
    none: free)."""
    identity = list(range(len(dag)))
    return {
        "format": FORMAT,
        "version": VERSION,
        "graph": graph,
        "nodes": [node_to_json(n) for n in dag.nodes],
        "edges": [[s, d] for s, d in dag.edges()],
        "orders": {
            "before": [int(i) for i in (identity if before is None else before)],
            "after": [int(i) for i in (identity if after is None else after)],
        },
        "durations_ms": [float(d) for d in (durations if durations is not None else [0.0] * len(dag))],
        "resident_bytes": int(dag.resident_bytes),
        "overlap": None if overlap is None else {"issue_ms": overlap.issue_ms,
                                                 "compute_slowdown": overlap.compute_slowdown},
        "meta": dict(meta or {}),
    }


def load_dag_dump(data: Mapping[str, Any]) -> DagDump:
    """Everything a ``dag.json`` document holds; raises ``DagJsonError`` naming what is wrong."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise DagJsonError(f"not a {FORMAT} document (missing \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise DagJsonError(f"{FORMAT} version {data.get('version')!r} is not supported (expected {VERSION})")
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list):
        raise DagJsonError("'nodes' must be a list")
    nodes = [node_from_json(n, where=f"nodes[{k}]") for k, n in enumerate(raw_nodes)]
    raw_edges = data.get("edges", [])
    if not isinstance(raw_edges, list) or not all(
        isinstance(e, list) and len(e) == 2 and all(isinstance(x, int) for x in e) for e in raw_edges
    ):
        raise DagJsonError("'edges' must be a list of [src, dst] node ids")
    try:
        dag = Dag(nodes, [tuple(e) for e in raw_edges], int(data.get("resident_bytes", 0)))
    except ValueError as exc:
        raise DagJsonError(str(exc)) from None
    orders = data.get("orders") or {}
    n = len(nodes)
    out_orders = []
    for key in ("before", "after"):
        order = orders.get(key, list(range(n)))
        if not isinstance(order, list) or sorted(order) != list(range(n)):
            raise DagJsonError(f"orders.{key} must be a permutation of the {n} node ids")
        out_orders.append([int(i) for i in order])
    durations = data.get("durations_ms", [0.0] * n)
    if not isinstance(durations, list) or len(durations) != n or not all(
        isinstance(d, (int, float)) and not isinstance(d, bool) for d in durations
    ):
        raise DagJsonError(f"'durations_ms' must be a list of {n} numbers")
    raw_overlap = data.get("overlap")
    overlap = None
    if raw_overlap is not None:
        if not isinstance(raw_overlap, Mapping) or set(raw_overlap) - {"issue_ms", "compute_slowdown"}:
            raise DagJsonError("'overlap' must be null or {\"issue_ms\": ms, \"compute_slowdown\": factor}")
        try:
            overlap = OverlapCosts(**{k: float(v) for k, v in raw_overlap.items()})
        except (TypeError, ValueError) as exc:
            raise DagJsonError(f"'overlap': {exc}") from None
    return DagDump(
        dag=dag,
        before=out_orders[0],
        after=out_orders[1],
        durations=[float(d) for d in durations],
        graph=str(data.get("graph", "")),
        meta=dict(data.get("meta") or {}),
        overlap=overlap,
    )


def dag_from_json(data: Mapping[str, Any] | str) -> Dag:
    """The ``Dag`` of a ``dag.json`` document (a parsed object or its JSON text)."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise DagJsonError(f"not valid JSON ({exc})") from None
    return load_dag_dump(data).dag


def read_dag_json(path: str | os.PathLike[str]) -> DagDump:
    """Load a ``dag.json`` file; ``DagJsonError`` (naming the file) when it is missing or malformed."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise DagJsonError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise DagJsonError(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise DagJsonError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        return load_dag_dump(data)
    except DagJsonError as exc:
        raise DagJsonError(f"{path}: {exc}") from None
