"""The bucket plans ``options`` ask for on one graph, the auto plan kept within the memory budget."""

from __future__ import annotations

import copy
from typing import Mapping

import torch.fx as fx

from ..bucketing.auto import plan_auto
from ..bucketing.manual import plan_manual
from ..bucketing.plan import Bucket, BucketPlanResult, break_cycles, make_bucket
from ..bucketing.rewrite import apply_buckets
from ..cost_model import CostModel
from ..dag.from_fx import dag_from_fx
from ..dag.graph import Dag, NodeKind
from ..options import Options
from ..simulate.memory import peak_memory

__all__ = ["plan_bucketing"]


def plan_bucketing(
    dag: Dag,
    options: Options,
    cost_model: CostModel | None = None,
    *,
    param_fqns: Mapping[str, str] | None = None,
    baseline_peak: int | None = None,
    budget_scale: float = 1.0,
) -> BucketPlanResult:
    """The plan ``options`` ask for, made acyclic (a bucket that would close a cycle is split).

    budget_scale: the auto planner plans against ``memory_budget * budget_scale`` (``bucket_graph`` lowers it
    when the simulated result overshoots the budget).
    """
    mode = options.bucketing
    if mode == "none":
        n = sum(1 for node in dag.nodes if node.kind is NodeKind.COLLECTIVE)
        return BucketPlanResult(buckets=[], unbucketed={}, n_collectives_before=n)
    if mode == "manual":
        if not options.bucket_plan:
            raise ValueError("fsdp_passes option bucket_plan is required when bucketing='manual'")
        plan = plan_manual(dag, options.bucket_plan, bucket_non_fsdp=options.bucket_non_fsdp,
                           param_fqns=param_fqns, strict=options.strict)
    elif mode == "auto":
        if cost_model is None:
            cost_model = CostModel.from_options(options.cluster, options.calibration)
        durations = cost_model.estimate(dag)
        if baseline_peak is None:
            baseline_peak = peak_memory(dag, list(range(len(dag.nodes))))
        budget = int(options.memory_budget_bytes(baseline_peak, dag.resident_bytes) * budget_scale)
        plan = plan_auto(dag, durations, cost_model, bucket_cap_mb=options.bucket_cap_mb,
                         memory_budget_bytes=budget, bucket_non_fsdp=options.bucket_non_fsdp)
    else:
        raise ValueError(f"fsdp_passes option bucketing={mode!r} is not valid: expected 'auto', 'manual' or 'none'")
    return break_cycles(dag, plan)


def _plan_auto_within_budget(g: fx.Graph, dag: Dag, options: Options, cost_model: CostModel, baseline_peak: int | None,
                             max_rounds: int = 4) -> tuple[BucketPlanResult, Dag | None, float, fx.Graph | None]:
    """Auto plan whose rewritten graph stays within the memory budget on the simulator's memory model.

    The planner's per-bucket memory estimate ignores buckets live at the same time (a gradient bucket while
    re-gathered parameters are held), so the plan is applied to a scratch copy of the graph, its peak
    simulated, and the plan redone with a proportionally smaller budget while it overshoots.  Returns the plan,
    the DAG of the rewritten copy (equal to what the real rewrite gives), the budget scale the plan was made
    with, and the rewritten copy itself (DAG and copy are None when nothing is merged).  This is the "greedy"
    candidate of ``choice.choose_auto_plan``.
    """
    base_peak = peak_memory(dag, list(range(len(dag)))) if baseline_peak is None else baseline_peak
    budget = options.memory_budget_bytes(base_peak, dag.resident_bytes)
    scale = 1.0
    plan = plan_bucketing(dag, options, cost_model, baseline_peak=base_peak)
    for _ in range(max_rounds):
        if not any(len(b) > 1 for b in plan.buckets):
            return plan, None, scale, None
        trial, trial_dag = _scratch_copy(g, dag)
        apply_buckets(trial, trial_dag, plan.buckets)
        after = dag_from_fx(trial)
        increase = peak_memory(after, list(range(len(after)))) - base_peak
        if increase <= budget:
            return plan, after, scale, trial
        scale *= max(0.0, budget / increase) * 0.9
        plan = plan_bucketing(dag, options, cost_model, baseline_peak=base_peak, budget_scale=scale)
    if any(len(b) > 1 for b in plan.buckets):  # still over after the last round: do not merge at all
        for b in plan.buckets:
            if len(b) > 1:
                b.close_reason = "memory"
        plan.buckets = [
            _single(dag, m, b.label) for b in plan.buckets for m in b.members
        ]
    return plan, None, 0.0, None


def _single(dag: Dag, m: int, label: str) -> Bucket:
    return make_bucket(dag, [m], close_reason="memory", label=label)


def _scratch_copy(g: fx.Graph, dag: Dag) -> tuple[fx.Graph, Dag]:
    """A copy of ``g`` and of ``dag`` pointing at the copy's nodes (same ids)."""
    new = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = new.graph_copy(g, val_map)
    new.output(out)
    nodes = []
    for node in dag.nodes:
        c = copy.copy(node)
        c.origin = val_map.get(node.origin, node.origin)
        nodes.append(c)
    return new, Dag(nodes, dag.edges(), dag.resident_bytes)
