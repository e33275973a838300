"""The bucket plans ``options`` ask for on one graph, within the memory budget and acyclic."""

from __future__ import annotations

from typing import Mapping

from ..bucketing.auto import plan_auto
from ..bucketing.manual import plan_manual
from ..bucketing.plan import BucketPlanResult, CollectiveSurvey, break_cycles, surveyed
from ..cost_model import CostModel
from ..dag.gc_pause import collector_paused
from ..dag.graph import Dag, NodeKind
from ..options import Options
from .budget import MemoryBudget, fit_to_budget, graph_memory_budget, trim_to_budget

__all__ = ["plan_bucketing"]


@collector_paused()
def plan_bucketing(
    dag: Dag,
    options: Options,
    cost_model: CostModel | None = None,
    *,
    param_fqns: Mapping[str, str] | None = None,
    survey: CollectiveSurvey | None = None,
    budget: MemoryBudget | None = None,
) -> BucketPlanResult:
    """The plan ``options`` ask for, within the memory budget and acyclic (a bucket that would close a cycle
    is split).  Rank-invariant: it reads the collectives, the graph's structure, the options and the cluster
    profile, never activation sizes.

    ``auto`` is the greedy planner alone (``bucket_graph`` also weighs the other candidates of
    ``choice.choose_auto_plan``); a ``manual`` plan's buckets over the memory limit are split
    (``trim_to_budget``).  ``survey``: ``dag``'s collectives judged with ``options.bucket_non_fsdp``
    (``bucketing.plan.survey_collectives``), if the caller has them; ``budget``: ``graph_memory_budget`` of
    ``dag`` with these ``options`` and ``param_fqns``, if the caller has it.
    """
    if not isinstance(dag, Dag):
        raise ValueError(f"plan_bucketing: dag={type(dag).__name__}; expected an fsdp_passes.dag.Dag")
    if not isinstance(options, Options):
        raise ValueError(f"plan_bucketing: options={type(options).__name__}; expected an fsdp_passes.Options")
    mode = options.bucketing
    if mode == "none":
        n = len(dag.collectives())
        return BucketPlanResult(buckets=[], unbucketed={}, n_collectives_before=n)
    # judged once: the budget's block claim and the planner both read it
    survey = surveyed(dag, options.bucket_non_fsdp, survey)
    if budget is None:
        budget = graph_memory_budget(dag, options, param_fqns=param_fqns, survey=survey)
    if mode == "manual":
        if not options.bucket_plan:
            raise ValueError("fsdp_passes option bucket_plan is required when bucketing='manual'")
        plan = plan_manual(dag, options.bucket_plan, bucket_non_fsdp=options.bucket_non_fsdp,
                           param_fqns=param_fqns, strict=options.strict, survey=survey)
        trim_to_budget(dag, plan, budget, strict=options.strict)
    elif mode == "auto":
        if cost_model is None:
            cost_model = CostModel.from_options(options.cluster, options.calibration)
        plan = plan_auto(dag, cost_model, bucket_cap_mb=options.bucket_cap_mb,
                         extra_bytes_limit=budget.limit, bucket_non_fsdp=options.bucket_non_fsdp, survey=survey)
        fit_to_budget(dag, plan, budget)
    else:
        raise ValueError(f"fsdp_passes option bucketing={mode!r} is not valid: expected 'auto', 'manual' or 'none'")
    return break_cycles(dag, plan)
