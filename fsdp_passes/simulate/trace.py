"""Chrome / Perfetto trace of simulated timelines, several runs side by side (e.g. "before" and "after").

Open the written JSON in https://ui.perfetto.dev or chrome://tracing.  Each run is a process with a
"compute" thread and one thread per process group; a wait that held the compute stream up appears on the
compute thread as "wait <collective>" for exactly the blocked time, so exposed communication is visible as
gaps filled by wait slices.  A "memory" counter follows the live bytes of the order.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from ..dag.graph import Dag, NodeKind
from .memory import wait_collectives
from .timeline import Timeline, group_key

_US_PER_MS = 1000.0
_COMPUTE_TID = 0


def _meta(name: str, pid: int, args: dict[str, Any], tid: int | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "name": name, "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _slice(name: str, cat: str, pid: int, tid: int, start_ms: float, dur_ms: float, args: dict) -> dict:
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": pid,
        "tid": tid,
        "ts": start_ms * _US_PER_MS,
        "dur": max(dur_ms, 0.0) * _US_PER_MS,
        "args": args,
    }


def _run_events(pid: int, run: str, dag: Dag, tl: Timeline) -> list[dict[str, Any]]:
    nodes = dag.nodes
    groups = list(dict.fromkeys(group_key(nodes[c].group_name) for c in dag.collectives()))
    tid_of = {g: k + 1 for k, g in enumerate(groups)}
    s = tl.summary()
    events: list[dict[str, Any]] = [
        _meta("process_name", pid, {"name": run}),
        _meta("process_sort_index", pid, {"sort_index": pid}),
        _meta(
            "process_labels",
            pid,
            {
                "labels": f"makespan {s['makespan_ms']:.3f} ms, exposed {s['exposed_comm_ms']:.3f} ms, "
                f"bound {s['lower_bound_ms']:.3f} ms, peak {s['peak_memory_bytes']} B"
            },
        ),
        _meta("thread_name", pid, {"name": "compute"}, _COMPUTE_TID),
        _meta("thread_sort_index", pid, {"sort_index": _COMPUTE_TID}, _COMPUTE_TID),
    ]
    for g, tid in tid_of.items():
        events.append(_meta("thread_name", pid, {"name": f"pg {g}"}, tid))
        events.append(_meta("thread_sort_index", pid, {"sort_index": tid}, tid))

    waited = wait_collectives(dag)
    for i in tl.order:
        node = nodes[i]
        if node.kind is NodeKind.COLLECTIVE:
            g = group_key(node.group_name)
            events.append(
                _slice(
                    node.name,
                    "collective",
                    pid,
                    tid_of[g],
                    tl.start[i],
                    tl.end[i] - tl.start[i],
                    {
                        "name": node.name,
                        "kind": node.kind.value,
                        "collective": node.collective.value if node.collective else None,
                        "group": g,
                        "bytes": node.comm_bytes,
                        "out_bytes": node.out_bytes,
                        "issue_ms": tl.issue[i],
                        "queued_ms": tl.start[i] - tl.issue[i],
                        "exposed_ms": tl.exposed.get(i, 0.0),
                    },
                )
            )
            continue
        if node.kind is NodeKind.WAIT:
            blocked = tl.wait_blocked.get(i, 0.0)
            c = waited[i]
            if blocked > 0.0:
                cname = nodes[c].name
                events.append(
                    _slice(
                        f"wait {cname}",
                        "wait",
                        pid,
                        _COMPUTE_TID,
                        tl.issue[i],
                        blocked,
                        {
                            "name": node.name,
                            "kind": node.kind.value,
                            "collective": cname,
                            "bytes": nodes[c].comm_bytes,
                            "exposed_ms": blocked,
                        },
                    )
                )
            own = tl.end[i] - tl.issue[i] - blocked
            if own <= 0.0:
                continue
            start = tl.issue[i] + blocked
        else:
            start = tl.start[i]
            own = tl.end[i] - start
        events.append(
            _slice(
                node.name,
                node.kind.value,
                pid,
                _COMPUTE_TID,
                start,
                own,
                {
                    "name": node.name,
                    "kind": node.kind.value,
                    "op": node.op,
                    "bytes": node.out_bytes,
                    "module": node.module_fqn,
                },
            )
        )

    # collectives and zero-time nodes share a timestamp: keep the highest value at each one so the
    # counter shows the peak rather than whichever position came last
    samples: dict[float, int] = {}
    for p, i in enumerate(tl.order):
        ts = tl.issue[i] * _US_PER_MS
        if tl.memory[p] >= samples.get(ts, -1):
            samples[ts] = tl.memory[p]
    for ts, value in samples.items():
        events.append(
            {"ph": "C", "name": "memory", "pid": pid, "tid": _COMPUTE_TID, "ts": ts, "args": {"bytes": value}}
        )
    return events


def chrome_trace(runs: Mapping[str, tuple[Dag, Timeline]]) -> dict[str, Any]:
    """Trace JSON object with one process per named run, in the mapping's order."""
    events: list[dict[str, Any]] = []
    for pid, (run, (dag, tl)) in enumerate(runs.items(), start=1):
        if len(tl.start) != len(dag.nodes):
            raise ValueError(f"run {run!r}: timeline covers {len(tl.start)} nodes, the DAG has {len(dag.nodes)}")
        events.extend(_run_events(pid, run, dag, tl))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike[str], runs: Mapping[str, tuple[Dag, Timeline]]) -> None:
    """Write ``chrome_trace(runs)`` as JSON to ``path`` (parent folders are created)."""
    trace = chrome_trace(runs)
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)
