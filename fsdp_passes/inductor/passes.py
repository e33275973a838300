"""The pass objects installed into ``torch._inductor.config`` (see ``install``).

- ``RecomputePinPass`` (a ``CustomGraphPass``) goes last into ``joint_custom_post_pass``: it fixes, before
  AOT autograd partitions the joint graph, which collectives the backward re-issues (``recompute_pins``).
- ``FsdpGraphPass`` (a ``CustomGraphPass``) goes into ``post_grad_custom_post_pass``: bucketing.
- ``FsdpSchedulerPass`` (a ``CustomSchedulerPass``) goes last into ``reorder_for_compute_comm_overlap_passes``
  (with ``reorder_for_compute_comm_overlap=True``): reordering.  That list runs after Inductor's
  peak-memory reordering, so nothing undoes the order it returns (``_post_fusion_custom_pass`` runs before
  ``reorder_for_peak_memory`` and would be undone).

Both passes of one compiled graph share its ``GraphRecord``: the first to run on the graph puts it into the
graph module's ``meta`` (the FX pass receives ``gm.graph``; the scheduler pass runs inside the
``GraphLowering`` of the same ``gm``), so the scheduler pass knows what the FX pass used of the memory
budget.  Every report also goes to the ``ReportHistory`` the two passes share (``fsdp_passes.last_reports``).

Cache keys: ``uuid()`` (``cache_key.pass_uuid``); the scheduler pass pickles as that uuid.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomSchedulerPass
from torch._inductor.scheduler import BaseSchedulerNode
from torch._inductor.virtualized import V

from ..dag.from_fx import UnplannableGraph
from ..options import Options
from ..pipeline.record import GraphRecord, ReportHistory
from ..pipeline.recompute_pins import pin_recompute_decisions
from ..pipeline.report import GraphReport
from . import fx_pass, scheduler_pass  # called through the modules: tests may wrap their functions
from .cache_key import pass_uuid
from .graph_names import GraphNamer, fx_graph_kind
from .guard import run_guarded
from .rank_check import RankChecker, insert_rank_check, is_rank_check

log = logging.getLogger("fsdp_passes")

__all__ = ["FsdpGraphPass", "FsdpSchedulerPass", "PassState", "RECORD_META_KEY", "RecomputePinPass"]

RECORD_META_KEY = "fsdp_passes_record"


@dataclass
class PassState:
    """What the installed pass objects share: graph names in compile order, the reports of every graph, the
    cross-rank check's state (``check_ranks``) and the gloo groups already warned about."""

    names: GraphNamer = field(default_factory=GraphNamer)
    history: ReportHistory = field(default_factory=ReportHistory)
    rank_checker: RankChecker = field(default_factory=RankChecker)
    gloo_groups_warned: set[str] = field(default_factory=set)


def _graph_module_meta(gm: Any) -> dict | None:
    meta = getattr(gm, "meta", None)
    return meta if isinstance(meta, dict) else None


class RecomputePinPass(CustomGraphPass):
    """Joint-graph pass: the partitioner's save / recompute choices cannot change the backward's collectives."""

    def __init__(self, options: Options) -> None:
        self.options = options

    def __call__(self, graph: fx.Graph) -> None:
        def attempt() -> None:
            pins = pin_recompute_decisions(graph)
            log.debug("fsdp_passes recompute pins: %s", pins)

        run_guarded("recompute-pin", self.options, attempt, lambda reason: None)

    def uuid(self) -> str:
        return pass_uuid("joint", self.options)


class FsdpGraphPass(CustomGraphPass):
    """Post-grad FX pass: bucket FSDP collectives (unless ``bucketing="none"``), then, with ``check_ranks``, put
    the cross-rank check of the final collective sequences at the top of the graph; the pass that was
    installed before ours runs first."""

    def __init__(self, options: Options, chained: Any = None, state: PassState | None = None):
        self.options = options
        self.chained = chained
        self.state = state or PassState()

    def __call__(self, graph: fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        record = GraphRecord(self.state.names.new_name(fx_graph_kind(graph)))
        meta = _graph_module_meta(graph.owning_module)
        if meta is not None:
            meta[RECORD_META_KEY] = record
        if self.options.bucketing != "none":
            record.fx = fx_pass.run_fx_pass(graph, self.options, graph_name=record.name)
            self.state.history.add(record.fx)
        if self.options.check_ranks:
            # after bucketing, which fixes every group's sequence: the scheduler pass never reorders a group
            try:
                insert_rank_check(graph, record.name, self.options.check_ranks_timeout_s)
            except UnplannableGraph as exc:  # unbacked sizes: no sequence to compare; by design, as the FX pass's
                log.info("fsdp_passes %s: check_ranks left out of this graph: %s", record.name, exc)
            except Exception as exc:
                if self.options.strict:
                    raise
                log.warning("fsdp_passes %s: check_ranks left out of this graph: %s: %s", record.name,
                            type(exc).__name__, exc)

    def uuid(self) -> str:
        return pass_uuid("fx", self.options, self.chained)


class GlooThreadsKey:
    """The cache-key part of the process groups this process has that are gloo with several worker threads."""

    def uuid(self) -> str:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return "no process group"
        from torch.distributed.distributed_c10d import _world

        from .gloo_groups import multi_threaded_gloo_groups

        names = [name for name in _world.pg_names.values() if isinstance(name, str)]
        return repr(sorted(multi_threaded_gloo_groups(names).items()))


def _restore_scheduler_pass(options_json: dict, uuid: str) -> "FsdpSchedulerPass":
    return FsdpSchedulerPass(Options(**options_json))


class FsdpSchedulerPass(CustomSchedulerPass):
    """Scheduler pass: reorder for overlap, validate the order, fall back to the input order on any problem."""

    def __init__(self, options: Options, state: PassState | None = None):
        self.options = options
        self.state = state or PassState()

    def _record(self) -> GraphRecord:
        """The record the FX pass made for the graph being lowered, or a new one."""
        meta = _graph_module_meta(getattr(V.graph, "module", None))
        record = meta.get(RECORD_META_KEY) if meta is not None else None
        if isinstance(record, GraphRecord):
            return record
        record = GraphRecord(self.state.names.new_name("bwd" if getattr(V.graph, "is_backward", False) else "fwd"))
        if meta is not None:
            meta[RECORD_META_KEY] = record
        return record

    def __call__(self, nodes: list[BaseSchedulerNode]) -> list[BaseSchedulerNode]:
        record = self._record()

        def attempt() -> list[BaseSchedulerNode]:
            order, record.scheduler = scheduler_pass.reorder_scheduler_nodes(
                nodes, self.options, graph_name=record.name, fx_report=record.fx)
            return order

        def fallback(reason: str) -> list[BaseSchedulerNode]:
            # the report (and dump) of the schedule as it was kept, so the numbers of the graph stay visible
            record.scheduler = scheduler_pass.unchanged_schedule_report(nodes, self.options, record.name, reason,
                                                         fx_report=record.fx)
            return nodes

        out = run_guarded("scheduler", self.options, attempt, lambda reason: fallback(f"pass failed: {reason}"),
                          lambda reason: fallback(f"left untouched: {reason}"))
        self.state.history.add(record.scheduler)
        self._warn_gloo_threads(record.scheduler)
        # the cross-rank check runs before any collective of the graph: it reads and writes no buffer, so
        # nothing else keeps it first (Inductor's memory reordering may have moved it)
        checks = [n for n in out if is_rank_check(n)]
        if checks:
            out = checks + [n for n in out if not is_rank_check(n)]
        return out

    def _warn_gloo_threads(self, report: GraphReport) -> None:
        """Say once per process group that it was kept to one collective in flight, and the fix."""
        for group, threads in sorted((report.extra.get("one_in_flight_groups") or {}).items()):
            if group in self.state.gloo_groups_warned:
                continue
            self.state.gloo_groups_warned.add(group)
            log.warning(
                "fsdp_passes: process group %r is gloo with %d worker threads: collectives in flight together on "
                "such a group corrupted the heap in benchmarks/gloo_view_race.py, so the reordering keeps one "
                "collective of it in flight at a time (less overlap). To prefetch again, run gloo groups on one "
                "worker thread: call fsdp_passes.testing.set_gloo_worker_threads(1) before "
                "torch.distributed.init_process_group / new_group.", group, threads)

    def uuid(self) -> str:
        # the order depends on which groups are gloo with several threads (kept to one in flight): a cached
        # order made under another thread count must not be served
        return pass_uuid("scheduler", self.options, chained=GlooThreadsKey())

    # the FX graph cache pickles this list into its key: pickle as the uuid, never as a qualified name only
    def __reduce__(self) -> tuple[Callable[..., "FsdpSchedulerPass"], tuple[dict, str]]:
        return (_restore_scheduler_pass, (self.options.to_json(), self.uuid()))
