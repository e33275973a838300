"""Running bucketing on one FX graph: plan (``bucketing.plan_manual`` / ``plan_auto``), rewrite, place, report.

``bucket_graph(graph, options)`` is the one call for a captured post-grad graph: it builds the DAG, plans
according to ``options.bucketing`` ("auto", "manual" with ``options.bucket_plan``, or "none"), rewrites the
graph in place and returns what it did.  See docs/bucketing.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch.fx as fx

from ..dag.from_fx import dag_from_fx
from ..dag.gc_pause import collector_paused
from ..dag.graph import CollectiveOp, Dag
from ..options import Options
from ..bucketing.manual import describe_entries, fqns_seen_hint
from ..bucketing.plan import Bucket, CollectiveSurvey, survey_collectives
from ..bucketing.placement import issue_gathers_before_reductions, renumbered
from ..bucketing.rewrite import RewriteStats, apply_buckets
from .budget import graph_memory_budget, memory_claim
from .plans import plan_bucketing

if TYPE_CHECKING:
    from ..cost_model import CostModel
    from .choice import AutoChoice
    from .report import GraphReport

__all__ = ["BucketingResult", "bucket_graph", "plan_bucketing"]


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
    choice: AutoChoice | None = None  # bucketing="auto": the candidates and their scores
    memory_budget_bytes: int = 0  # memory_budget in bytes for this graph
    memory_budget_used_bytes: int = 0  # the plan's claim on it (budget.memory_claim), placement included
    report: GraphReport | None = None  # this graph's report (pass_name "fx")
    #: collective name -> {"param": parameter FQN or None, "module": module FQN or None} (bucketable ones)
    attribution: dict[str, dict[str, str | None]] = field(default_factory=dict)
    #: collective name -> why no parameter or module name was found for it
    unattributed: dict[str, str] = field(default_factory=dict)
    #: blocks found among the collectives' FQNs (repeated sibling modules: ``layers.0``, ``model.h.1``...)
    blocks: list[str] = field(default_factory=list)

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
        if self.blocks:
            lines.append(f"  blocks: {', '.join(self.blocks)}")
        for name, why in self.unattributed.items():
            lines.append(f"  {name}: no parameter or module name ({why})")
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
            "attribution": dict(self.attribution),
            "unattributed": dict(self.unattributed),
            "blocks": list(self.blocks),
            "memory_budget_bytes": self.memory_budget_bytes,
            "memory_budget_used_bytes": self.memory_budget_used_bytes,
            **({"auto_choice": self.choice.to_json()} if self.choice is not None else {}),
        }


@collector_paused()
def bucket_graph(
    graph: fx.Graph | fx.GraphModule,
    options: Options | None = None,
    cost_model: CostModel | None = None,
    *,
    param_fqns: Mapping[str, str] | None = None,
    graph_name: str = "graph",
    before_merging: Callable[[], None] | None = None,
) -> BucketingResult:
    """Bucket the FSDP collectives of a post-grad FX graph in place, as ``options`` say.

    cost_model: a ``fsdp_passes.cost_model.CostModel`` for ``bucketing="auto"`` (default: one built from
        ``options.cluster`` / ``options.calibration``).
    param_fqns: placeholder name -> parameter FQN, for manual plans when nodes do not record it.
    graph_name: names the graph in ``result.report``.
    before_merging: called once, right before the first merge changes the graph's nodes (not called when
        nothing merges); everything else the pass may do to the graph is moving nodes, which restoring the
        node order undoes.  ``inductor.fx_pass`` copies the graph there, for its fallback.

    Memory: the plan's rank-invariant claim (``budget.memory_claim``) stays within ``memory_budget``; the
    claim is reported (``report.budget``) and the scheduler pass keeps the rest.

    Manual plan entries that match nothing raise ``UnmatchedPlanEntry`` (a ``ValueError``) when
    ``options.strict``; otherwise they are reported in the result and warned about.
    """
    if not isinstance(graph, (fx.Graph, fx.GraphModule)):
        raise ValueError(f"bucket_graph: graph={type(graph).__name__}; expected a torch.fx.Graph or GraphModule "
                         f"(a post-grad graph: see fsdp_passes.testing.capture_fx_graphs)")
    if options is not None and not isinstance(options, Options):
        raise ValueError(f"bucket_graph: options={type(options).__name__}; expected an fsdp_passes.Options or None")
    options = options or Options()
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    dag = dag_from_fx(g)
    if cost_model is None and options.bucketing != "none":
        from ..cost_model import CostModel

        cost_model = CostModel.from_options(options.cluster, options.calibration)
    # each collective judged once, for the budget, the planners and the attribution; the budget computed once,
    # for the planners, the re-gathers' room and the report
    survey = survey_collectives(dag, bucket_non_fsdp=options.bucket_non_fsdp)
    budget = graph_memory_budget(dag, options, param_fqns=param_fqns, survey=survey)
    # the kernels of the graph as it is, predicted once for auto's score and the report (and before the rewrite
    # changes the FX nodes the prediction reads)
    kernels = None
    if cost_model is not None:
        from ..dag.fusion import predict_kernels

        kernels = predict_kernels(dag)
    choice = None
    if options.bucketing == "auto":
        from .choice import choose_auto_plan

        choice = choose_auto_plan(dag, options, cost_model, budget, param_fqns=param_fqns, kernels=kernels,
                                  survey=survey)
        plan = choice.plan
    else:
        plan = plan_bucketing(dag, options, cost_model, param_fqns=param_fqns, survey=survey, budget=budget)
    if plan.unmatched_entries:
        warnings.warn(
            f"fsdp_passes: bucket_plan entries {describe_entries(plan.unmatched_entries)} matched no "
            f"bucketable collective of graph {graph_name} ({plan.n_collectives_before} collectives)"
            + fqns_seen_hint(plan.fqns_seen),
            stacklevel=2,
        )
    attribution, unattributed, blocks = attribute_collectives(dag, param_fqns, options.bucket_non_fsdp, survey)
    if before_merging is not None and any(len(b) > 1 for b in plan.buckets):
        before_merging()
    stats = apply_buckets(graph, dag, plan.buckets)
    used = memory_claim(plan.buckets)
    # the DAG of the graph as it is now: the same as before when nothing was merged (the graph is untouched)
    after = dag_from_fx(g) if stats.n_buckets else dag
    if options.reorder:
        # re-gathers ahead of the reductions before them, for reductions whose inputs fit in what is left
        others = memory_claim([b for b in plan.buckets if b.op is not CollectiveOp.REDUCE_SCATTER])
        moved_bytes: list[int] = []
        stats.gathers_ahead_of_reductions = issue_gathers_before_reductions(
            g, after, max_moved_bytes=budget.total - others, moved_bytes=moved_bytes)
        if stats.gathers_ahead_of_reductions:
            after = renumbered(after, g) or dag_from_fx(g)
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
        attribution=attribution,
        unattributed=unattributed,
        blocks=blocks,
        memory_budget_bytes=budget.total,
        memory_budget_used_bytes=used,
    )
    result.report = _report(result, dag, after, options, cost_model, graph_name, kernels)
    return result



def attribute_collectives(dag: Dag, param_fqns: Mapping[str, str] | None = None, bucket_non_fsdp: bool = False,
                          survey: CollectiveSurvey | None = None,
                          ) -> tuple[dict[str, dict[str, str | None]], dict[str, str], list[str]]:
    """Per bucketable collective, the parameter it moves and the module that ran it; the ones with neither,
    and why; and the blocks they fall into, in graph order: repeated sibling modules of their FQNs, else
    repetitions of the graph's structure (``<repeat>.<j>``).  ``survey``: ``dag``'s collectives judged with
    ``bucket_non_fsdp``, if the caller has them."""
    from ..bucketing.manual import collective_fqn
    from ..bucketing.plan import param_name, surveyed
    from ..bucketing.blocks import collective_blocks

    attribution: dict[str, dict[str, str | None]] = {}
    unattributed: dict[str, str] = {}
    fqns: dict[int, str | None] = {}
    survey = surveyed(dag, bucket_non_fsdp, survey)
    for c in survey.keys:
        node = dag.nodes[c]
        param = param_name(node)
        if not param and param_fqns and node.param_fqn:
            param = param_fqns.get(node.param_fqn)
        attribution[node.name] = {"param": param, "module": node.module_fqn}
        fqns[c] = collective_fqn(node, param_fqns)
        if not param and not node.module_fqn:
            unattributed[node.name] = (
                "its input is not a chain of casts / views / gathers from a parameter Dynamo saw (or the pre-grad "
                "pass did not run), and the node has no nn_module_stack / fwd_nn_module_stack / module_fqn meta")
    blocks: list[str] = []
    block_of = collective_blocks(dag, fqns, survey.keys)
    for c in fqns:
        key = block_of[c]
        parts = key.split(".") if key else []
        if key and len(parts) > 1 and parts[-1].isdigit() and key not in blocks:
            blocks.append(key)
    return attribution, unattributed, blocks


def _describe_choice(choice: AutoChoice) -> str:
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


def _report(result: BucketingResult, before: Dag, after: Dag, options: Options, cost_model: CostModel | None,
            graph_name: str, before_kernels: Dag | None = None) -> GraphReport:
    """A ``GraphReport`` (pass "fx"): counts and the memory budget always; simulated time and memory (on the
    kernels predicted from the FX graph: for information, the promise is kept at the scheduler level) with a
    cost model.  ``before`` / ``after``: the DAGs of the graph before and after the pass (the same object when
    it is unchanged); ``before_kernels``: ``predict_kernels(before)``, taken before the rewrite."""
    from .report import GraphBudget, GraphReport, collective_fingerprint, fill_schedule_numbers

    report = GraphReport(graph=graph_name, pass_name="fx", n_collectives_before=result.n_collectives_before,
                         n_collectives_after=result.n_collectives_after, options=options.to_json())
    report.extra["bucketing"] = result.to_json()
    report.budget = GraphBudget(result.memory_budget_bytes, result.memory_budget_used_bytes)
    report.collective_fingerprint = collective_fingerprint(after)
    if cost_model is not None:
        from ..dag.fusion import predict_kernels
        from ..dag.memory_reorder import predict_memory_reorder

        # timed and sized as the kernels Inductor generates from the graph, in the order its peak-memory
        # reordering gives them: as the scheduler pass sees them
        unchanged = after is before
        before = predict_kernels(before) if before_kernels is None else before_kernels
        timed_before = (before, predict_memory_reorder(before), cost_model.estimate(before))
        if unchanged:
            timed_after = timed_before
        else:
            after = predict_kernels(after)
            timed_after = (after, predict_memory_reorder(after), cost_model.estimate(after))
        fill_schedule_numbers(report, timed_before, timed_after, cost_model.overlap_costs())
    return report
