"""End-to-end measurements of a compile: per-group collective sequences and the peak of the final order.

Both come from the scheduler nodes Inductor would generate code from (``capture_scheduler_nodes``), read by
the one scheduler-node adapter and the one memory model (``fsdp_passes.simulate.peak_memory``), so a
compile with the passes and one without them are measured the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from .capture import SchedulerCapture, capture_scheduler_nodes

__all__ = ["GraphMeasure", "measure_compile", "per_group_sequences"]


@dataclass
class GraphMeasure:
    """One compiled graph: its name, each process group's collectives in issue order of the final order
    (``"op group bytes dtype"`` strings), and the simulated peak memory of that order in bytes."""

    graph_name: str
    sequences: dict[str, list[str]]
    peak_bytes: int


def _dag(capture: SchedulerCapture, which: str) -> Any:
    from ..inductor.scheduler_adapter import dag_from_scheduler_nodes

    with capture.graph_context():
        return dag_from_scheduler_nodes(getattr(capture, which))


def _per_group(dag: Any) -> dict[str, list[str]]:
    from ..pipeline.report import collective_sequence

    out: dict[str, list[str]] = {}
    for item in collective_sequence(dag):
        out.setdefault(item.split(" ")[1], []).append(item)
    return out


def per_group_sequences(capture: SchedulerCapture, which: str = "after") -> dict[str, list[str]]:
    """Each process group's collective sequence in ``capture.after`` (or ``.before``)."""
    return _per_group(_dag(capture, which))


def _measure(capture: SchedulerCapture) -> GraphMeasure:
    from ..simulate import peak_memory

    dag = _dag(capture, "after")
    return GraphMeasure(capture.graph_name, _per_group(dag), peak_memory(dag, list(range(len(dag)))))


def measure_compile(fn: Callable[..., Any], *args: Any, options: Optional[Mapping[str, Any]] = None,
                    **kwargs: Any) -> list[GraphMeasure]:
    """Compile ``fn(*args)`` up to Inductor's final scheduler order (with ``fsdp_passes.enabled(**options)``,
    or with no passes when ``options`` is None) and measure every graph: see :class:`GraphMeasure`."""
    return [_measure(c) for c in capture_scheduler_nodes(fn, *args, options=options, **kwargs)]
