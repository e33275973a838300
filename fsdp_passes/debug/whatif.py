"""What-if: re-estimate a dumped graph on another cluster profile and/or world size.

World-size scaling (``scale_world_size``).  The process groups whose size equals the largest group size of
the dump (the data-parallel "world" the FSDP collectives run on) are resized to the new world size; smaller
groups (tensor-parallel, HSDP replicas...) keep their size.  Two conventions for the payloads:

* ``fixed="model"`` (default): the same model on more or fewer ranks.  Full sizes (a gathered parameter, a
  gradient before its reduce-scatter) stay, so an all-gather's / reduce-scatter's ``comm_bytes`` and the
  buffer the compute reads are unchanged, and the per-rank shard (an all-gather's input, a
  reduce-scatter's output) becomes ``full // new_size``.  Compute nodes are unchanged (same per-rank batch).
* ``fixed="shard"``: each rank keeps its shard size, so full sizes scale with the group size
  (``full * new_size / old_size``) - a model grown with the job.  Compute nodes are still unchanged,
  so this isolates what the larger collectives cost.

All-reduce and all-to-all payloads are per-rank buffers and never change.  Process-group ranks become
``0..new_size-1``.  Durations are then re-estimated with the chosen profile (analytically, or from a
calibration table), so estimates that came from a calibration in the original run are not reused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from ..dag.collectives import KINDS
from ..dag.graph import Dag

FIXED = ("model", "shard")


def world_size_of(dag: Dag) -> int | None:
    """The largest process-group size among the DAG's collectives (None without collectives)."""
    sizes = [dag.nodes[c].group_size for c in dag.collectives() if dag.nodes[c].group_size]
    return max(sizes) if sizes else None


def scale_world_size(dag: Dag, world_size: int, fixed: str = "model") -> Dag:
    """A copy of ``dag`` with its world-sized process groups resized to ``world_size`` (see module doc)."""
    if fixed not in FIXED:
        raise ValueError(f"fixed={fixed!r}: expected one of {', '.join(FIXED)}")
    if world_size < 1:
        raise ValueError(f"world size {world_size} is not valid: expected an integer >= 1")
    old = world_size_of(dag)
    nodes = [dataclasses.replace(n) for n in dag.nodes]
    if old is not None and old != world_size:
        for c in dag.collectives():
            node = nodes[c]
            if node.group_size != old:
                continue
            node.group_size = world_size
            node.group_ranks = tuple(range(world_size))
            kind = KINDS.get(node.collective)
            if kind is None or kind.shard_field is None:
                continue  # both sides full size (all-reduce, all-to-all): per-rank buffers, unchanged
            if fixed == "model":
                setattr(node, kind.shard_field, node.comm_bytes // world_size)
            else:
                node.comm_bytes = node.comm_bytes * world_size // old
                setattr(node, kind.full_field, getattr(node, kind.full_field) * world_size // old)
    return Dag(nodes, list(dag.edges()), dag.resident_bytes)


@dataclass
class WhatIf:
    """Predicted numbers of one graph under another profile / world size."""

    graph: str
    n_nodes: int
    world_size_before: int | None
    world_size_after: int
    before_ms: float
    before_exposed_ms: float
    dumped_ms: float
    dumped_exposed_ms: float
    planned_ms: float | None
    planned_exposed_ms: float | None
    lower_bound_ms: float
    planner: str  # "plan_order", or why it did not run


def what_if(
    dump: Any,
    cluster: Any,
    world_size: int | None = None,
    fixed: str = "model",
    calibration: str | None = None,
    memory_budget: Any = None,
    max_prefetch: int | None = None,
    replan: bool = True,
) -> WhatIf:
    """Re-estimate a ``DagDump`` (``read_dag_json``): the order before the pass, the dumped order after it
    and, when ``fsdp_passes.reordering.plan_order`` is available, a fresh plan for the new numbers."""
    from ..cost_model import CostModel
    from ..options import Options
    from ..simulate import lower_bound, simulate

    dag = dump.dag
    old_world = world_size_of(dag)
    if world_size is not None:
        dag = scale_world_size(dag, world_size, fixed)
    model = CostModel.from_options(cluster, calibration)
    durations = model.estimate(dag)
    overlap = model.overlap_costs()
    t_before = simulate(dag, dump.before, durations, overlap)
    t_dumped = simulate(dag, dump.after, durations, overlap)
    planned = planned_exposed = None
    planner = "not run"
    if replan:
        try:
            from ..reordering import plan_order
        except ImportError:
            planner = "planner not available (fsdp_passes.reordering.plan_order)"
        else:
            options = dump.meta.get("options") or {}
            budget = memory_budget if memory_budget is not None else options.get("memory_budget",
                                                                                  Options().memory_budget)
            prefetch = max_prefetch if max_prefetch is not None else options.get("max_prefetch")
            from ..pipeline.budget import graph_memory_budget

            result = plan_order(dag, durations,
                                memory_budget_bytes=graph_memory_budget(dag, Options(memory_budget=budget)).total,
                                max_prefetch=prefetch, overlap=overlap)
            t_planned = simulate(dag, list(result.order), durations, overlap)
            planned, planned_exposed = t_planned.makespan, t_planned.exposed_total
            planner = "plan_order"
    return WhatIf(
        graph=dump.graph,
        n_nodes=len(dag),
        world_size_before=old_world,
        world_size_after=world_size if world_size is not None else (old_world or 1),
        before_ms=t_before.makespan,
        before_exposed_ms=t_before.exposed_total,
        dumped_ms=t_dumped.makespan,
        dumped_exposed_ms=t_dumped.exposed_total,
        planned_ms=planned,
        planned_exposed_ms=planned_exposed,
        lower_bound_ms=lower_bound(dag, durations),
        planner=planner,
    )


def what_if_table(results: Sequence[WhatIf]) -> str:
    """Per graph and in total: step time and exposed comm before the pass, with the dumped order, re-planned."""
    from .tables import align

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    rows = [["graph", "nodes", "world", "before ms", "exposed", "dumped order ms", "exposed", "re-planned ms",
             "exposed", "lower bound"]]
    for r in results:
        world = f"{r.world_size_before}->{r.world_size_after}" if r.world_size_before != r.world_size_after \
            else str(r.world_size_after)
        rows.append([r.graph, str(r.n_nodes), world, ms(r.before_ms), ms(r.before_exposed_ms), ms(r.dumped_ms),
                     ms(r.dumped_exposed_ms), ms(r.planned_ms), ms(r.planned_exposed_ms), ms(r.lower_bound_ms)])
    if len(results) > 1:
        def total(attr: str) -> float | None:
            vals = [getattr(r, attr) for r in results]
            return None if any(v is None for v in vals) else sum(vals)

        rows.append(["step (sum)", str(sum(r.n_nodes for r in results)), "", ms(total("before_ms")),
                     ms(total("before_exposed_ms")), ms(total("dumped_ms")), ms(total("dumped_exposed_ms")),
                     ms(total("planned_ms")), ms(total("planned_exposed_ms")), ms(total("lower_bound_ms"))])
    return "\n".join(align(rows, [False] + [True] * 9)) + "\n"
