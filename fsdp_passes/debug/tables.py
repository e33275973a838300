"""Plain-text tables: one schedule (``schedule_before.txt`` / ``schedule_after.txt``) and the per-graph
summaries the command line prints."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..dag.graph import Dag, NodeKind
from ..simulate.timeline import Timeline, group_key

SCHEDULE_COLUMNS = ("pos", "was", "name", "kind", "op", "group", "bytes", "est_ms", "start_ms", "end_ms", "exposed_ms")
_RIGHT = {"pos", "was", "bytes", "est_ms", "start_ms", "end_ms", "exposed_ms"}
_OP_WIDTH = 48


def _fmt_ms(x: float) -> str:
    return f"{x:.4f}"


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def align(rows: Sequence[Sequence[str]], right: Sequence[bool], sep: str = "  ") -> list[str]:
    """Rows of cells padded into columns (``right[k]``: right-align column k)."""
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))] if rows else []
    out = []
    for r in rows:
        cells = [c.rjust(w) if right[k] else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))]
        out.append(sep.join(cells).rstrip())
    return out


def schedule_rows(dag: Dag, order: Sequence[int], durations: Sequence[float], timeline: Timeline,
                  was: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """One dict per position of ``order``: the values the schedule table prints (numbers unformatted)."""
    waited: dict[int, int] = {}
    for i, node in enumerate(dag.nodes):
        if node.kind is NodeKind.WAIT and node.collective_of is not None:
            waited[i] = node.collective_of
    was_pos = {i: p for p, i in enumerate(was)} if was is not None else None
    rows = []
    for pos, i in enumerate(order):
        node = dag.nodes[i]
        if node.kind is NodeKind.COLLECTIVE:
            op = node.collective.value if node.collective else node.op
            group = group_key(node.group_name)
            nbytes = node.comm_bytes
            exposed = timeline.exposed.get(i, 0.0)
        elif node.kind is NodeKind.WAIT:
            c = waited.get(i)
            op = f"wait {dag.nodes[c].name}" if c is not None else node.op
            group = group_key(dag.nodes[c].group_name) if c is not None else (node.group_name or "")
            nbytes = dag.nodes[c].comm_bytes if c is not None else node.out_bytes
            exposed = timeline.wait_blocked.get(i, 0.0)
        else:
            op = node.op
            group = ""
            nbytes = node.out_bytes
            exposed = 0.0
        rows.append({
            "pos": pos,
            "was": was_pos[i] if was_pos is not None else pos,
            "id": i,
            "name": node.name,
            "kind": node.kind.value,
            "op": op,
            "group": group,
            "bytes": int(nbytes),
            "est_ms": float(durations[i]),
            "start_ms": timeline.start[i],
            "end_ms": timeline.end[i],
            "exposed_ms": exposed,
        })
    return rows


def schedule_table(dag: Dag, order: Sequence[int], durations: Sequence[float], timeline: Timeline,
                   title: str = "", was: Sequence[int] | None = None) -> str:
    """The schedule as aligned text: '#' comment lines, a header row, one row per node of ``order``.

    Columns: pos (position in this order), was (position in ``was``, the order before the pass), name, kind
    (compute / collective / wait), op (collective type, "wait <collective>" or the kernel), group (process
    group), bytes (a collective's payload, a wait's collective's payload, a compute node's output), est_ms
    (cost-model estimate), start_ms / end_ms (simulated; a collective on its group's stream), exposed_ms
    (a collective: time it held the compute stream up; a wait: time it blocked).
    """
    s = timeline.summary()
    lines = []
    if title:
        lines.append(f"# {title}")
    comm = ", ".join(f"pg {g} {ms:.4f} ms" for g, ms in sorted(s["comm_ms"].items())) or "none"
    lines.append(
        f"# {len(order)} nodes; makespan {s['makespan_ms']:.4f} ms, exposed comm {s['exposed_comm_ms']:.4f} ms, "
        f"compute {s['compute_busy_ms']:.4f} ms, lower bound {s['lower_bound_ms']:.4f} ms"
    )
    lines.append(f"# peak memory {s['peak_memory_bytes']} B ({format_bytes(s['peak_memory_bytes'])}); comm {comm}")
    cells = [list(SCHEDULE_COLUMNS)]
    for r in schedule_rows(dag, order, durations, timeline, was):
        op = r["op"] if len(r["op"]) <= _OP_WIDTH else r["op"][: _OP_WIDTH - 3] + "..."
        cells.append([
            str(r["pos"]), str(r["was"]), r["name"], r["kind"], op or "-", r["group"] or "-", str(r["bytes"]),
            _fmt_ms(r["est_ms"]), _fmt_ms(r["start_ms"]), _fmt_ms(r["end_ms"]), _fmt_ms(r["exposed_ms"]),
        ])
    lines.extend(align(cells, [c in _RIGHT for c in SCHEDULE_COLUMNS]))
    return "\n".join(lines) + "\n"


def parse_schedule_table(text: str) -> list[dict[str, str]]:
    """Rows of a schedule table as dicts of cell text (for tools and tests); '#' lines are skipped."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    if not lines:
        return []
    header = lines[0].split()
    out = []
    for ln in lines[1:]:
        cells = ln.split()
        if len(cells) != len(header):  # an op with spaces ("wait <name>"): join the op cells back
            extra = len(cells) - len(header)
            k = header.index("op")
            cells = cells[:k] + [" ".join(cells[k: k + extra + 1])] + cells[k + extra + 1:]
        out.append(dict(zip(header, cells)))
    return out


# -- per-graph summaries (report / demo) ---------------------------------------------------------------------

_METRICS = (
    ("collectives", "n_collectives_before", "n_collectives_after", "count"),
    ("exposed comm ms", "exposed_comm_ms_before", "exposed_comm_ms_after", "ms"),
    ("makespan ms", "makespan_ms_before", "makespan_ms_after", "ms"),
    ("peak memory", "peak_memory_bytes_before", "peak_memory_bytes_after", "bytes"),
)


def _fmt(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "count":
        return str(int(value))
    if unit == "bytes":
        return format_bytes(value)
    return f"{float(value):.3f}"


def _change(before: Any, after: Any) -> str:
    if before is None or after is None:
        return ""
    before, after = float(before), float(after)
    if before == after:
        return "="
    if before == 0:
        return f"{after - before:+g}"
    return f"{(after - before) / abs(before) * 100:+.1f}%"


def summary_table(summary: Mapping[str, Any]) -> str:
    """One graph's summary.json as a before / after / change table."""
    head = summary.get("graph", "?")
    notes = []
    if summary.get("collectives_moved") is not None:
        notes.append(f"{summary['collectives_moved']} collectives moved")
    if summary.get("pass_time_s") is not None:
        notes.append(f"{float(summary['pass_time_s']) * 1e3:.1f} ms in passes")
    lines = [head + (f"  ({', '.join(notes)})" if notes else "")]
    if summary.get("fallback"):
        lines.append(f"  FELL BACK (schedule unchanged): {summary['fallback']}")
    fx = summary.get("fx")
    if isinstance(fx, Mapping) and fx.get("fallback"):
        lines.append(f"  bucketing FELL BACK (graph unchanged): {fx['fallback']}")
    note = (summary.get("extra") or {}).get("note")
    if note:
        lines.append(f"  note: {note}")
    rows = [["", "before", "after", "change"]]
    for label, kb, ka, unit in _METRICS:
        b, a = summary.get(kb), summary.get(ka)
        rows.append([label, _fmt(b, unit), _fmt(a, unit), _change(b, a)])
    rows.append(["lower bound ms", "", _fmt(summary.get("lower_bound_ms"), "ms"), ""])
    lines.extend("  " + ln for ln in align(rows, [False, True, True, True]))
    return "\n".join(lines) + "\n"


def totals(summaries: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Sums over graphs: a training step runs each graph once, so makespans add up to the step time."""
    keys = ("n_collectives_before", "n_collectives_after", "exposed_comm_ms_before", "exposed_comm_ms_after",
            "makespan_ms_before", "makespan_ms_after", "lower_bound_ms")
    out = {k: sum(float(s.get(k) or 0.0) for s in summaries) for k in keys}
    out["peak_memory_bytes_before"] = max((int(s.get("peak_memory_bytes_before") or 0) for s in summaries), default=0)
    out["peak_memory_bytes_after"] = max((int(s.get("peak_memory_bytes_after") or 0) for s in summaries), default=0)
    return out


def totals_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    t = totals(summaries)
    t["graph"] = f"all {len(summaries)} graphs (step = sum of makespans; peak = largest graph's)"
    return summary_table(t)


def comparison_table(a: Mapping[str, Any], b: Mapping[str, Any], label_a: str = "A", label_b: str = "B") -> str:
    """Two summaries of one graph side by side; the last column is B after relative to A after."""
    name_a, name_b = a.get("graph", "?"), b.get("graph", "?")
    lines = [name_a if name_a == name_b else f"{name_a}  vs  {name_b}"]
    rows = [["", f"{label_a} before", f"{label_a} after", f"{label_b} before", f"{label_b} after",
             f"{label_b}/{label_a} after"]]
    for label, kb, ka, unit in _METRICS:
        rows.append([label, _fmt(a.get(kb), unit), _fmt(a.get(ka), unit), _fmt(b.get(kb), unit),
                     _fmt(b.get(ka), unit), _change(a.get(ka), b.get(ka))])
    rows.append(["lower bound ms", "", _fmt(a.get("lower_bound_ms"), "ms"), "", _fmt(b.get("lower_bound_ms"), "ms"),
                 _change(a.get("lower_bound_ms"), b.get("lower_bound_ms"))])
    for s, label in ((a, label_a), (b, label_b)):
        if s.get("fallback"):
            lines.append(f"  {label} FELL BACK: {s['fallback']}")
    lines.extend("  " + ln for ln in align(rows, [False, True, True, True, True, True]))
    return "\n".join(lines) + "\n"
