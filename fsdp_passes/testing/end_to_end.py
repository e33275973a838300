"""End-to-end measurements of a compile: per-group collective sequences, the peak and the simulated step of
the final order.

All come from the scheduler nodes Inductor would generate code from (``capture_scheduler_nodes``), read by
the one scheduler-node adapter, priced by the cost model and replayed by the one engine
(``fsdp_passes.simulate``), so a compile with the passes and one without them are measured the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from .capture import SchedulerCapture, capture_scheduler_nodes

__all__ = ["GraphMeasure", "measure_compile", "per_group_sequences"]


@dataclass
class GraphMeasure:
    """One compiled graph: its name, each process group's collectives in issue order of the final order
    (``"op group bytes dtype"`` strings), the simulated peak memory of that order in bytes, and its
    simulated makespan and exposed communication in ms (the cluster profile of the options, else
    ``h100-nvlink``)."""

    graph_name: str
    sequences: dict[str, list[str]]
    peak_bytes: int
    makespan_ms: float
    exposed_ms: float


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


def _measure(capture: SchedulerCapture, cost_model: Any) -> GraphMeasure:
    from ..simulate import peak_memory, simulate

    dag = _dag(capture, "after")
    order = list(range(len(dag)))
    timeline = simulate(dag, order, cost_model.estimate(dag), cost_model.overlap_costs())
    return GraphMeasure(capture.graph_name, _per_group(dag), peak_memory(dag, order), timeline.makespan,
                        timeline.exposed_total)


def measure_compile(fn: Callable[..., Any], *args: Any, options: Optional[Mapping[str, Any]] = None,
                    **kwargs: Any) -> list[GraphMeasure]:
    """Compile ``fn(*args)`` up to Inductor's final scheduler order (with ``fsdp_passes.enabled(**options)``,
    or with no passes when ``options`` is None) and measure every graph: see :class:`GraphMeasure`."""
    from ..cost_model import CostModel
    from ..options import Options

    opts = Options(**dict(options or {}))
    cost_model = CostModel.from_options(opts.cluster, opts.calibration)
    return [_measure(c, cost_model) for c in capture_scheduler_nodes(fn, *args, options=options, **kwargs)]
