"""What one pass did to one compiled graph: the numbers logged, dumped and returned to tests."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from ..dag.graph import Dag, NodeKind
from ..options import Options
from ..simulate import OverlapCosts, Timeline, lower_bound, simulate


@dataclass(frozen=True)
class GraphBudget:
    """A graph's memory budget, as the FX pass hands it to the scheduler pass of the same graph: the budget in
    bytes (``Options.memory_budget_bytes`` of the graph) and the FX pass's claim on it (``budget.memory_claim``
    of its plan: bucketing and gather placement).  Reordering may raise the peak by the rest."""

    memory_budget_bytes: int
    memory_budget_used_bytes: int

    @property
    def reorder_budget_bytes(self) -> int:
        """What the FX pass left of the budget: how far reordering may raise the peak of its input order."""
        return max(0, self.memory_budget_bytes - self.memory_budget_used_bytes)


@dataclass
class GraphReport:
    graph: str  # e.g. "000_fwd": compile order, then forward / backward / inference
    pass_name: str  # "fx" (bucketing) or "scheduler" (reordering)
    n_collectives_before: int = 0
    n_collectives_after: int = 0
    exposed_comm_ms_before: float = 0.0
    exposed_comm_ms_after: float = 0.0
    makespan_ms_before: float = 0.0
    makespan_ms_after: float = 0.0
    lower_bound_ms: float = 0.0
    peak_memory_bytes_before: int = 0
    peak_memory_bytes_after: int = 0
    pass_time_s: float = 0.0
    collective_fingerprint: str = ""
    collectives_moved: int = 0
    fallback: str | None = None  # why the original graph / order was kept, if it was
    budget: GraphBudget | None = None  # the graph's memory budget (a pass that fell back has none)
    options: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # set once the DEBUG log has said why nodes moved (``debug.log_move_reasons``); not annotated, so not a
    # dataclass field: kept out of to_json, == and repr
    reasons_logged = False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def one_line(self) -> str:
        return (
            f"{self.graph} [{self.pass_name}] collectives {self.n_collectives_before} -> {self.n_collectives_after}, "
            f"exposed comm {self.exposed_comm_ms_before:.3f} -> {self.exposed_comm_ms_after:.3f} ms, "
            f"makespan {self.makespan_ms_before:.3f} -> {self.makespan_ms_after:.3f} ms "
            f"(lower bound {self.lower_bound_ms:.3f}), peak memory {self.peak_memory_bytes_before} -> "
            f"{self.peak_memory_bytes_after} B, {self.collectives_moved} collectives moved, "
            f"{self.pass_time_s * 1e3:.1f} ms in pass" + (f", FELL BACK: {self.fallback}" if self.fallback else "")
        )


def collective_fingerprint(dag: Dag, order: list[int] | None = None) -> str:
    """A hash of each process group's collective sequence (op, group, bytes, dtype) in issue order.

    Ranks that disagree on it would issue different collectives and hang; comparing it across ranks
    (``fsdp_passes.verify_rank_consistency``) finds that before the first step does.
    """
    order = list(range(len(dag))) if order is None else order
    per_group: dict[str, list[list[Any]]] = {}
    for i in order:
        node = dag.nodes[i]
        if node.kind is NodeKind.COLLECTIVE:
            per_group.setdefault(node.group_name or "?", []).append(
                [node.collective.value if node.collective else "?", node.group_name, node.comm_bytes, node.dtype]
            )
    text = json.dumps(sorted(per_group.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def collective_sequence(dag: Dag, order: list[int] | None = None) -> list[str]:
    """The collectives of ``dag`` in issue order (``order``, default graph order), one ``"op group bytes dtype"``
    string each: what ``collective_fingerprint`` hashes, readable (it names the collective where ranks differ)."""
    order = list(range(len(dag))) if order is None else order
    out = []
    for i in order:
        node = dag.nodes[i]
        if node.kind is NodeKind.COLLECTIVE:
            op = node.collective.value if node.collective else "?"
            out.append(f"{op} {node.group_name or '?'} {node.comm_bytes} {node.dtype}")
    return out


def fill_schedule_numbers(
    report: GraphReport,
    before: tuple[Dag, list[int], list[float]],
    after: tuple[Dag, list[int], list[float]],
    overlap: OverlapCosts | None = None,
) -> tuple[Timeline, Timeline]:
    """Simulate the graph before and after a pass and put the numbers into ``report``.

    ``before`` and ``after`` are (dag, order, per-node durations in ms); ``overlap``: what overlapping costs
    (``CostModel.overlap_costs``), the same for both.  Returns both timelines.
    """
    t_before = simulate(*before, overlap=overlap)
    t_after = simulate(*after, overlap=overlap)
    report.n_collectives_before = len(before[0].collectives())
    report.n_collectives_after = len(after[0].collectives())
    report.exposed_comm_ms_before = t_before.exposed_total
    report.exposed_comm_ms_after = t_after.exposed_total
    report.makespan_ms_before = t_before.makespan
    report.makespan_ms_after = t_after.makespan
    report.lower_bound_ms = lower_bound(after[0], after[2])
    report.peak_memory_bytes_before = t_before.peak_memory
    report.peak_memory_bytes_after = t_after.peak_memory
    report.collective_fingerprint = collective_fingerprint(after[0], after[1])
    report.extra["collective_sequence"] = collective_sequence(after[0], after[1])
    return t_before, t_after


def fill_unchanged_numbers(report: GraphReport, build_dag: Callable[[], Dag], options: Options
                           ) -> tuple[Dag, list[float], OverlapCosts, tuple[Timeline, Timeline]] | None:
    """Fill the ``report`` of a graph a pass left unchanged (it fell back) with the numbers of the graph as it
    was left, before == after: its collective count (of the DAG ``build_dag`` returns) and, when a cost model
    can be built from ``options``, its simulated time and memory.  Returns what that simulation used (the
    DAG, its durations, the overlap costs, both timelines) for a dump, or None when nothing was simulated.
    Never raises: the graph is left alone anyway, and the report says what could not be shown."""
    try:
        dag = build_dag()
        report.n_collectives_before = report.n_collectives_after = len(dag.collectives())
        cost_model = _unchanged_cost_model(options, report)
        if cost_model is None:
            return None
        identity = list(range(len(dag)))
        durations = cost_model.estimate(dag)
        overlap = cost_model.overlap_costs()
        timelines = fill_schedule_numbers(report, (dag, identity, durations), (dag, identity, durations), overlap)
        return dag, durations, overlap, timelines
    except Exception as exc:
        report.extra["numbers_unavailable"] = f"{type(exc).__name__}: {exc}"
        return None


def _unchanged_cost_model(options: Options, report: GraphReport) -> Any:
    """The cost model to simulate a graph a pass left unchanged: the options' one, else the cluster profile
    alone (the calibration may be what failed), else None; what was dropped goes into ``report.extra``."""
    from ..cost_model import CostModel, load_profile

    try:
        return CostModel.from_options(options.cluster, options.calibration)
    except Exception as exc:
        report.extra["cost_model_note"] = f"calibration not used ({type(exc).__name__}: {exc})"
    try:
        return CostModel(load_profile(options.cluster))
    except Exception as exc:
        report.extra["cost_model_note"] = f"no cost model ({type(exc).__name__}: {exc})"
        return None
