"""The bucket plans ``options`` ask for on one graph, within the memory budget and acyclic."""

from __future__ import annotations

import copy
import warnings
from typing import Mapping

from ..bucketing.auto import plan_auto
from ..bucketing.manual import describe_entries, plan_manual
from ..bucketing.plan import BucketPlanResult, break_cycles, fsdp_payload_bytes
from ..cost_model import CostModel
from ..dag.gc_pause import collector_paused
from ..dag.graph import Dag, NodeKind
from ..options import Options
from .choice import fit_to_budget, memory_limits

__all__ = ["BucketOverBudget", "graph_memory_budget", "plan_bucketing", "trim_to_budget"]


@collector_paused()
def plan_bucketing(
    dag: Dag,
    options: Options,
    cost_model: CostModel | None = None,
    *,
    param_fqns: Mapping[str, str] | None = None,
) -> BucketPlanResult:
    """The plan ``options`` ask for, within the memory budget and acyclic (a bucket that would close a cycle
    is split).  Rank-invariant: it reads the collectives, the graph's structure, the options and the cluster
    profile, never activation sizes.

    ``auto`` is the greedy planner alone (``bucket_graph`` also weighs the other candidates of
    ``choice.choose_auto_plan``); a ``manual`` plan's buckets over the memory limit are split
    (``trim_to_budget``).
    """
    mode = options.bucketing
    if mode == "none":
        n = sum(1 for node in dag.nodes if node.kind is NodeKind.COLLECTIVE)
        return BucketPlanResult(buckets=[], unbucketed={}, n_collectives_before=n)
    budget = graph_memory_budget(dag, options)
    if mode == "manual":
        if not options.bucket_plan:
            raise ValueError("fsdp_passes option bucket_plan is required when bucketing='manual'")
        plan = plan_manual(dag, options.bucket_plan, bucket_non_fsdp=options.bucket_non_fsdp,
                           param_fqns=param_fqns, strict=options.strict)
        trim_to_budget(dag, plan, budget, strict=options.strict)
    elif mode == "auto":
        if cost_model is None:
            cost_model = CostModel.from_options(options.cluster, options.calibration)
        plan = plan_auto(dag, cost_model, bucket_cap_mb=options.bucket_cap_mb,
                         memory_budget_bytes=memory_limits(dag, budget), bucket_non_fsdp=options.bucket_non_fsdp)
        fit_to_budget(dag, plan, budget)
    else:
        raise ValueError(f"fsdp_passes option bucketing={mode!r} is not valid: expected 'auto', 'manual' or 'none'")
    return break_cycles(dag, plan)


def graph_memory_budget(dag: Dag, options: Options) -> int:
    """``options.memory_budget`` in bytes for the graph of ``dag``: a percentage is of its FSDP payload
    (``fsdp_payload_bytes``), the same on every rank."""
    return options.memory_budget_bytes(fsdp_payload_bytes(dag))


class BucketOverBudget(ValueError):
    """A manual plan's bucket would take the peak over the memory budget (raised with ``strict=True``)."""


def trim_to_budget(dag: Dag, plan: BucketPlanResult, budget: int, *, strict: bool) -> list[str]:
    """Split the buckets of a manual ``plan`` that would take it over ``budget`` (``choice.fit_to_budget``),
    warning with their names, or raise ``BucketOverBudget`` when ``strict``.  Returns the split buckets'
    labels."""
    over = fit_to_budget(dag, plan, budget) if not strict else fit_to_budget(dag, copy.deepcopy(plan), budget)
    if not over:
        return []
    names = [f"{b.label or b.member_names[0]} ({b.op.value}, {len(b)} collectives)" for b in over]
    message = (f"fsdp_passes: bucket_plan buckets {describe_entries(names)} would take the peak over "
               f"memory_budget={budget} B")
    if strict:
        raise BucketOverBudget(message + "; raise memory_budget or make the plan finer")
    warnings.warn(message + ": split into smaller buckets", stacklevel=3)
    return [b.label for b in over]
