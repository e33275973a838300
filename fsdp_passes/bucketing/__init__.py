"""Bucketing: merge FSDP collectives (what to merge: ``plan_manual`` / ``plan_auto``; how: ``apply_buckets``).

``bucket_graph(graph, options)`` is the one call for a captured post-grad graph: it builds the DAG, plans
according to ``options.bucketing`` ("auto", "manual" with ``options.bucket_plan``, or "none"), rewrites the
graph in place and returns what it did.  See docs/bucketing.md.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.fx as fx

from ..dag.from_fx import dag_from_fx
from ..dag.graph import CollectiveOp, Dag
from ..options import Options
from .auto import plan_auto
from .choice import fit_to_budget, memory_claim, memory_limits
from .manual import UnmatchedPlanEntry, describe_entries, expand_pattern, expand_plan, plan_manual
from .plan import Bucket, BucketPlanResult, break_cycles, fsdp_payload_bytes, plan_cycles
from .placement import issue_gathers_before_reductions
from .rewrite import BUCKET_META_KEY, RewriteStats, apply_buckets

__all__ = [
    "BUCKET_META_KEY",
    "Bucket",
    "BucketOverBudget",
    "BucketPlanResult",
    "BucketingResult",
    "RewriteStats",
    "UnmatchedPlanEntry",
    "apply_buckets",
    "bucket_graph",
    "expand_pattern",
    "expand_plan",
    "graph_memory_budget",
    "plan_auto",
    "plan_bucketing",
    "plan_cycles",
    "plan_manual",
    "trim_to_budget",
]


@dataclass
class BucketingResult:
    """What ``bucket_graph`` did to one graph.

    ``buckets``: every planned bucket (single-member ones included: their ``close_reason`` says why they did
    not grow); ``unbucketed``: collective name -> why it was not considered; ``unmatched_entries``: manual
    plan entries that matched nothing in this graph (only when not strict); ``collectives``: names of the
    merged collectives now in the graph.
    """

    mode: str
    buckets: list[Bucket]
    n_collectives_before: int
    n_collectives_after: int
    unbucketed: dict[str, str] = field(default_factory=dict)
    unmatched_entries: list[str] = field(default_factory=list)
    collectives: list[str] = field(default_factory=list)
    rewrite: RewriteStats | None = None
    choice: Any = None  # bucketing="auto": the .choice.AutoChoice (candidates and their scores)
    memory_budget_bytes: int = 0  # memory_budget in bytes for this graph
    memory_budget_used_bytes: int = 0  # the plan's claim on it (choice.memory_claim), placement included
    report: Any = None  # fsdp_passes.report.GraphReport for this graph (pass_name "fx")

    @property
    def merged(self) -> list[Bucket]:
        return [b for b in self.buckets if len(b) > 1]

    def summary(self) -> str:
        lines = [
            f"bucketing={self.mode}: {self.n_collectives_before} -> {self.n_collectives_after} collectives "
            f"({len(self.merged)} merged buckets)"
        ]
        if self.choice is not None:
            lines.append("  " + _describe_choice(self.choice))
        for b in self.merged:
            lines.append(
                f"  {b.op.value} pg={b.group_name} {b.dtype} x{len(b)} {b.comm_bytes} B [{b.label}] "
                f"closed by {b.close_reason}"
            )
        if self.unmatched_entries:
            lines.append(f"  plan entries matching nothing: {', '.join(self.unmatched_entries)}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "n_collectives_before": self.n_collectives_before,
            "n_collectives_after": self.n_collectives_after,
            "buckets": [b.to_json() for b in self.buckets],
            "unbucketed": dict(self.unbucketed),
            "unmatched_entries": list(self.unmatched_entries),
            "collectives": list(self.collectives),
            "gathers_ahead_of_reductions": self.rewrite.gathers_ahead_of_reductions if self.rewrite else 0,
            "memory_budget_bytes": self.memory_budget_bytes,
            "memory_budget_used_bytes": self.memory_budget_used_bytes,
            **({"auto_choice": self.choice.to_json()} if self.choice is not None else {}),
        }


def plan_bucketing(
    dag: Dag,
    options: Options,
    cost_model: Any = None,
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
        from ..dag.graph import NodeKind

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
            from ..cost_model import CostModel

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


def bucket_graph(
    graph: fx.Graph | fx.GraphModule,
    options: Options | None = None,
    cost_model: Any = None,
    *,
    param_fqns: Mapping[str, str] | None = None,
    graph_name: str = "graph",
) -> BucketingResult:
    """Bucket the FSDP collectives of a post-grad FX graph in place, as ``options`` say.

    cost_model: a ``fsdp_passes.cost_model.CostModel`` for ``bucketing="auto"`` (default: one built from
        ``options.cluster`` / ``options.calibration``).
    param_fqns: placeholder name -> parameter FQN, for manual plans when nodes do not record it.
    graph_name: names the graph in ``result.report``.

    Memory: the plan's rank-invariant claim (``choice.memory_claim``) stays within ``memory_budget``; the
    claim is reported (``report.extra["memory_budget_used_bytes"]``) and the scheduler pass keeps the rest.
    Manual plan entries that match nothing raise ``UnmatchedPlanEntry`` (a ``ValueError``) when
    ``options.strict``; otherwise they are reported in the result and warned about.
    """
    options = options or Options()
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    dag = dag_from_fx(g)
    if cost_model is None and options.bucketing != "none":
        from ..cost_model import CostModel

        cost_model = CostModel.from_options(options.cluster, options.calibration)
    budget = graph_memory_budget(dag, options)
    choice = None
    if options.bucketing == "auto":
        from .choice import choose_auto_plan

        choice = choose_auto_plan(dag, options, cost_model, budget, param_fqns=param_fqns)
        plan = choice.plan
    else:
        plan = plan_bucketing(dag, options, cost_model, param_fqns=param_fqns)
    if plan.unmatched_entries:
        warnings.warn(
            f"fsdp_passes: bucket_plan entries {describe_entries(plan.unmatched_entries)} matched no "
            f"bucketable collective of graph with {plan.n_collectives_before} collectives",
            stacklevel=2,
        )
    stats = apply_buckets(graph, dag, plan.buckets)
    used = memory_claim(plan.buckets)
    if options.reorder:
        # re-gathers ahead of the reductions before them, for reductions whose inputs fit in what is left
        others = memory_claim([b for b in plan.buckets if b.op is not CollectiveOp.REDUCE_SCATTER])
        moved_bytes: list[int] = []
        stats.gathers_ahead_of_reductions = issue_gathers_before_reductions(
            g, dag_from_fx(g), max_moved_bytes=budget - others, moved_bytes=moved_bytes)
        used = memory_claim(plan.buckets, max(moved_bytes, default=0))
    result = BucketingResult(
        mode=options.bucketing,
        buckets=plan.buckets,
        n_collectives_before=plan.n_collectives_before,
        n_collectives_after=plan.n_collectives_after,
        unbucketed={dag.nodes[i].name: why for i, why in sorted(plan.unbucketed.items())},
        unmatched_entries=list(plan.unmatched_entries),
        collectives=list(stats.collectives),
        rewrite=stats,
        choice=choice,
        memory_budget_bytes=budget,
        memory_budget_used_bytes=used,
    )
    result.report = _report(result, dag, g, options, cost_model, graph_name)
    return result


def _describe_choice(choice: Any) -> str:
    parts = []
    for c in choice.candidates:
        if c.skipped:
            parts.append(f"{c.name} skipped ({c.skipped})")
        elif c.same_as:
            parts.append(f"{c.name}=={c.same_as}")
        elif c.rejected:
            parts.append(f"{c.name} rejected ({c.rejected})")
        else:
            parts.append(f"{c.name} {c.makespan_ms:.4g} ms / exposed {c.exposed_ms:.4g} ms / {c.n_collectives} coll")
    return f"auto chose {choice.chosen} of: " + "; ".join(parts)


def _report(result: BucketingResult, before: Dag, g: fx.Graph, options: Options, cost_model: Any,
            graph_name: str) -> Any:
    """A ``GraphReport`` (pass "fx"): counts and the memory budget always; simulated time and memory (on the
    unfused FX graph: for information, the promise is kept at the scheduler level) with a cost model."""
    from ..report import GraphReport, collective_fingerprint, fill_schedule_numbers

    report = GraphReport(graph=graph_name, pass_name="fx", n_collectives_before=result.n_collectives_before,
                         n_collectives_after=result.n_collectives_after, options=options.to_json())
    report.extra["bucketing"] = result.to_json()
    report.extra["memory_budget_bytes"] = result.memory_budget_bytes
    report.extra["memory_budget_used_bytes"] = result.memory_budget_used_bytes
    after = dag_from_fx(g) if result.merged or result.rewrite.gathers_ahead_of_reductions else before
    report.collective_fingerprint = collective_fingerprint(after)
    if cost_model is not None:
        fill_schedule_numbers(
            report,
            (before, list(range(len(before))), cost_model.estimate(before)),
            (after, list(range(len(after))), cost_model.estimate(after)),
        )
    return report
