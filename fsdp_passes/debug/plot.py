"""``timeline.png``: simulated timelines one above the other (needs matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Mapping

from ..dag.graph import Dag, NodeKind
from ..simulate.timeline import group_key

log = logging.getLogger("fsdp_passes")

_COLOURS = {"compute": "#4c78a8", "wait": "#e45756", "collective": "#f58518"}


def can_plot() -> bool:
    """Whether matplotlib (which ``write_timeline_png`` needs) can be imported."""
    try:
        from matplotlib.figure import Figure  # noqa: F401
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=1)
def matplotlib_missing_note() -> str:
    """Why timeline.png is not written; logged at INFO the first time it is asked for in a process."""
    note = "timeline.png skipped: matplotlib is not installed (pip install 'fsdp_passes[plot]')"
    log.info("fsdp_passes: %s", note)
    return note


def write_timeline_png(path: str | os.PathLike[str], dag: Dag, runs: Mapping[str, Any], title: str = "") -> bool:
    """Draw each run (name -> Timeline) as a panel with a compute row and one row per process group.

    Returns False, writing nothing, when matplotlib is not importable.
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
    except Exception:
        return False

    groups = list(dict.fromkeys(group_key(dag.nodes[c].group_name) for c in dag.collectives()))
    rows = ["compute"] + [f"pg {g}" for g in groups]
    end = max((tl.makespan for tl in runs.values()), default=1.0) or 1.0
    fig = Figure(figsize=(14, 1.2 + 0.5 * len(rows) * len(runs)))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)
    for ax, (run, tl) in zip(axes[:, 0], runs.items()):
        bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for i in tl.order:
            node = dag.nodes[i]
            if node.kind is NodeKind.COLLECTIVE:
                key = (1 + groups.index(group_key(node.group_name)), "collective")
                bars.setdefault(key, []).append((tl.start[i], tl.end[i] - tl.start[i]))
            elif node.kind is NodeKind.WAIT:
                blocked = tl.wait_blocked.get(i, 0.0)
                if blocked > 0:
                    bars.setdefault((0, "wait"), []).append((tl.issue[i], blocked))
            elif tl.end[i] > tl.start[i]:
                bars.setdefault((0, "compute"), []).append((tl.start[i], tl.end[i] - tl.start[i]))
        for (row, kind), spans in bars.items():
            ax.broken_barh(spans, (len(rows) - 1 - row - 0.4, 0.8), facecolors=_COLOURS[kind],
                           edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(list(reversed(rows)))
        ax.set_xlim(0, end * 1.02)
        ax.set_title(f"{run}: makespan {tl.makespan:.3f} ms, exposed comm {tl.exposed_total:.3f} ms "
                     "(red: compute stream blocked on a wait)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    return True
