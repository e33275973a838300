"""``bucketing="auto"``: choose among a few candidate plans by what the simulator says after reordering.

The greedy planner (``auto.py``) judges each merge on its own timeline model, which assumes every collective
is issued as soon as it is ready.  The reordering pass does not always manage that (memory budget, one FIFO
stream per group), and a plan that looks best to the greedy model can be worse once reordered: a single
bucket of every forward gather cannot be prefetched under anything and exposes its whole transfer.  So
``choose_auto_plan`` builds at most four candidates on the DAG:

0. ``greedy``: the greedy plan, kept within the memory budget as before (``_plan_auto_within_budget``);
1. ``per_block``: one bucket per module block per (op, group, reduce op, dtype): collectives are grouped by
   the top-level repeated module prefix (``layers.<i>``, ``model.layers.<i>``: the FQN up to its first
   integer component, where that prefix holds at least two indices); everything else by its top-level
   module (``tok_embeddings``, ``norm``, ``output``), each its own bucket;
2. ``none``: no merging;
3. ``greedy_half_cap``: greedy with the size cap at half the bytes of the largest block bucket (only when
   that changes the greedy plan),

and scores each one the way the graph will run: the plan is applied to a scratch copy of the FX graph
(``apply_buckets``), the backward re-gathers are placed ahead of the reductions as ``bucket_graph`` does,
the DAG is rebuilt, the cost model prices it, ``plan_order`` reorders it (identity when ``reorder`` is off)
and the simulator replays the order.  Score: simulated makespan, then exposed communication, then fewer
collectives, then the candidate's index.  All of it is a pure function of the graph, the options and the
cost model, so every rank chooses the same plan.

Memory: the unbucketed graph's peak in graph order plus ``memory_budget`` is one limit for bucketing and
reordering together.  A candidate whose rewritten graph already peaks above it is rejected; the others are
reordered with the room left under it (``limit - candidate peak``), so a reordered candidate never peaks
above the limit either.  ``none`` never exceeds it, so there is always a winner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.fx as fx

from ..dag.graph import Dag, NodeKind
from ..options import Options
from ..bucketing.blocks import plan_per_block, plan_unmerged
from ..bucketing.plan import BucketPlanResult
from ..cost_model import CostModel

#: above this many DAG nodes the candidates are not scored (each score rewrites a copy of the graph and runs
#: the reordering planner on it: ~0.3 s per 1k nodes for the three rewrites on 2 cores); the greedy plan is
#: used and the report says so
MAX_SCORED_NODES = 12_000

CANDIDATES = ("greedy", "per_block", "none", "greedy_half_cap")

# ms: makespans / exposed times closer than this count as equal, so the tie-breaks decide
_TIE_MS = 1e-6


def _signature(plan: BucketPlanResult) -> tuple:
    return tuple(sorted(tuple(b.members) for b in plan.buckets if len(b) > 1))


# -- scoring ---------------------------------------------------------------------------------------------------

@dataclass
class CandidateScore:
    """One candidate plan and what the simulator says about it (times in ms, memory in bytes)."""

    index: int
    name: str
    plan: BucketPlanResult = field(repr=False)
    n_collectives: int = 0
    makespan_ms: float | None = None
    exposed_ms: float | None = None
    peak_bytes: int | None = None
    rejected: str | None = None  # why it cannot be chosen (over the memory limit); None if it can
    skipped: str | None = None  # why it was not built (e.g. the greedy plan is already that small)
    same_as: str | None = None  # an earlier candidate with the same buckets (not scored again)
    reorder_fallback: str | None = None  # plan_order kept the graph order, and why
    note: str | None = None
    after: Dag | None = field(default=None, repr=False)

    def key(self) -> tuple:
        return (round(self.makespan_ms / _TIE_MS), round(self.exposed_ms / _TIE_MS), self.n_collectives, self.index)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "name": self.name,
            "n_collectives": self.n_collectives,
            "n_merged_buckets": sum(1 for b in self.plan.buckets if len(b) > 1),
            "makespan_ms": self.makespan_ms,
            "exposed_ms": self.exposed_ms,
            "peak_bytes": self.peak_bytes,
            "rejected": self.rejected,
        }
        for k in ("skipped", "same_as", "reorder_fallback", "note"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out


@dataclass
class AutoChoice:
    """What ``choose_auto_plan`` decided: the winning plan, the DAG of the graph it gives, and why."""

    plan: BucketPlanResult
    after: Dag | None
    chosen: str
    candidates: list[CandidateScore]
    scored: bool
    baseline_peak: int
    budget_bytes: int
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "chosen": self.chosen,
            "scored": self.scored,
            "baseline_peak_bytes": self.baseline_peak,
            "memory_budget_bytes": self.budget_bytes,
            "memory_limit_bytes": self.baseline_peak + self.budget_bytes,
            "score": "simulated makespan after reordering, then exposed comm, then fewer collectives, then index",
            "candidates": [c.to_json() for c in self.candidates],
        }
        if self.note:
            out["note"] = self.note
        return out


def scoring_durations(dag: Dag, cost_model: CostModel) -> list[float]:
    """``cost_model.estimate(dag)`` with views (compute nodes that allocate nothing: they live in their input's
    buffer, a graph input's included) at 0 ms.

    No kernel runs for a view in the generated code, but on an FX DAG the cost model sees a view's input
    bytes and charges it a kernel launch.  A bucket adds a few views per member (the flattening before the
    copy-in, the split and reshape after the wait), so with those charges every merge would look a few
    microseconds per member slower than it is, and unmerged plans would win on that alone.  Collectives are
    priced by ``cost_model.collective_ms``.
    """
    durations = list(cost_model.estimate(dag))
    for i, node in enumerate(dag.nodes):
        if node.kind is NodeKind.COMPUTE and not node.flops and (node.alias_of is not None or not node.out_bytes):
            durations[i] = 0.0
        elif node.kind is NodeKind.COLLECTIVE and node.collective is not None:
            # the price the greedy planner judges merges by (the same as estimate() for a CostModel); an
            # all-reduce of a group unknown to this process is priced as 2 ranks, as the planner does
            durations[i] = float(cost_model.collective_ms(node.collective, node.comm_bytes, node.group_size or 2,
                                                          node.group_ranks))
    return durations


def score_plan(g: fx.Graph, dag: Dag, plan: BucketPlanResult, options: Options, cost_model: CostModel,
               baseline_peak: int, budget: int, score: CandidateScore, *,
               rewritten: tuple[fx.Graph, Dag] | None = None) -> CandidateScore:
    """Fill ``score`` with the simulated figures of ``plan`` applied to a copy of ``g`` (``g`` is untouched).

    rewritten: a scratch copy of ``g`` with ``plan`` already applied, and its DAG (the greedy candidate's,
        from the memory check), to save a rewrite.
    """
    from ..dag.from_fx import dag_from_fx
    from ..simulate import peak_memory, simulate
    from .plans import _scratch_copy
    from ..bucketing.rewrite import apply_buckets

    limit = baseline_peak + budget
    trial: fx.Graph | None = None
    if rewritten is not None:
        trial, after = rewritten
    elif any(len(b) > 1 for b in plan.buckets):
        trial, trial_dag = _scratch_copy(g, dag)
        apply_buckets(trial, trial_dag, plan.buckets)
        after = dag_from_fx(trial)
    else:
        after = dag  # nothing merged: the graph as it is
    if options.reorder and _gathers_behind_reductions(after):
        # as bucket_graph does after the rewrite: re-gathers ahead of the reductions before them, if the
        # result stays within the budget (else the graph order stays as it was: ``after`` as is)
        after = _placed(trial if trial is not None else g, after, limit, restore=trial is None)
    score.after = after
    score.n_collectives = sum(1 for node in after.nodes if node.kind is NodeKind.COLLECTIVE)
    identity = list(range(len(after)))
    peak0 = peak_memory(after, identity)
    if peak0 > limit:
        score.peak_bytes = peak0
        score.rejected = f"rewritten graph peaks at {peak0} B > limit {limit} B (baseline peak + budget)"
        return score
    durations = scoring_durations(after, cost_model)
    if options.reorder:
        from ..reordering import plan_order

        res = plan_order(after, durations, memory_budget_bytes=limit - peak0, max_prefetch=options.max_prefetch)
        stats = res.after
        score.makespan_ms, score.exposed_ms, score.peak_bytes = stats.makespan_ms, stats.exposed_ms, stats.peak_bytes
        score.reorder_fallback = res.fallback
    else:
        tl = simulate(after, identity, durations)
        score.makespan_ms, score.exposed_ms, score.peak_bytes = (float(tl.makespan), float(tl.exposed_total),
                                                                 int(tl.peak_memory))
    if score.peak_bytes > limit:  # plan_order keeps its limit; kept as a guard
        score.rejected = f"reordered graph peaks at {score.peak_bytes} B > limit {limit} B (baseline peak + budget)"
    return score


def _placed(graph: fx.Graph, dag: Dag, limit: int, *, restore: bool) -> Dag:
    """DAG of ``graph`` (whose DAG is ``dag``) after ``issue_gathers_before_reductions``, or ``dag`` if that
    moves nothing or peaks above ``limit``.  ``restore``: put ``graph``'s nodes back in their order after."""
    from ..dag.from_fx import dag_from_fx
    from ..simulate import peak_memory
    from ..bucketing.placement import issue_gathers_before_reductions, renumbered, restore_order

    order = list(graph.nodes) if restore else None
    try:
        if not issue_gathers_before_reductions(graph, dag):
            return dag
        placed = renumbered(dag, graph) or dag_from_fx(graph)
    finally:
        if order is not None:
            restore_order(order)
    return placed if peak_memory(placed, list(range(len(placed)))) <= limit else dag


def _gathers_behind_reductions(dag: Dag) -> bool:
    """Whether ``issue_gathers_before_reductions`` could move anything: some group issues a reduction right
    before an FSDP all-gather."""
    from ..dag.graph import CollectiveOp

    reductions = (CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE)
    for seq in dag.group_sequences().values():
        for a, b in zip(seq, seq[1:]):
            nb = dag.nodes[b]
            if nb.collective is CollectiveOp.ALL_GATHER and nb.fsdp and dag.nodes[a].collective in reductions:
                return True
    return False


def choose_auto_plan(
    g: fx.Graph,
    dag: Dag,
    options: Options,
    cost_model: CostModel,
    baseline_peak: int,
    *,
    param_fqns: Mapping[str, str] | None = None,
    max_scored_nodes: int = MAX_SCORED_NODES,
) -> AutoChoice:
    """Build the candidates for ``g`` (whose DAG is ``dag``), score them, return the best (see the module
    docstring).  ``g`` is not modified."""
    from .plans import _plan_auto_within_budget, plan_bucketing
    from ..bucketing.plan import break_cycles

    budget = options.memory_budget_bytes(baseline_peak, dag.resident_bytes)
    greedy_plan, greedy_after, scale, greedy_trial = _plan_auto_within_budget(g, dag, options, cost_model,
                                                                              baseline_peak)
    if len(dag) > max_scored_nodes:
        cand = CandidateScore(0, "greedy", greedy_plan, n_collectives=greedy_plan.n_collectives_after,
                              note="not scored")
        return AutoChoice(plan=greedy_plan, after=greedy_after, chosen="greedy", candidates=[cand], scored=False,
                          baseline_peak=baseline_peak, budget_bytes=budget,
                          note=f"{len(dag)} nodes > {max_scored_nodes}: candidates not scored, greedy plan used")

    cap_bytes = None if options.bucket_cap_mb is None else int(options.bucket_cap_mb * 2**20)
    per_block = break_cycles(dag, plan_per_block(dag, bucket_non_fsdp=options.bucket_non_fsdp,
                                                 param_fqns=param_fqns, cap_bytes=cap_bytes,
                                                 memory_budget_bytes=int(budget * scale),
                                                 durations=cost_model.estimate(dag)))
    plans: list[tuple[str, BucketPlanResult | None, str | None]] = [
        ("greedy", greedy_plan, None),
        ("per_block", per_block, None),
        ("none", plan_unmerged(dag, greedy_plan), None),
    ]
    largest_block = max((b.comm_bytes for b in per_block.buckets if len(b) > 1), default=0)
    largest_greedy = max((b.comm_bytes for b in greedy_plan.buckets if len(b) > 1), default=0)
    half = largest_block // 2
    if half <= 0:
        plans.append(("greedy_half_cap", None, "no multi-member block bucket"))
    elif largest_greedy <= half:
        plans.append(("greedy_half_cap", None, f"greedy buckets are already <= {half} B"))
    else:
        cap_mb = half / 2**20
        if options.bucket_cap_mb is not None:
            cap_mb = min(cap_mb, options.bucket_cap_mb)
        half_plan = plan_bucketing(dag, options.replace(bucket_cap_mb=cap_mb), cost_model,
                                   baseline_peak=baseline_peak, budget_scale=scale)
        plans.append(("greedy_half_cap", half_plan, f"cap {int(cap_mb * 2**20)} B"))

    scores: list[CandidateScore] = []
    seen: dict[tuple, CandidateScore] = {}
    for index, (name, plan, note) in enumerate(plans):
        if plan is None:
            scores.append(CandidateScore(index, name, BucketPlanResult([], {}, 0), skipped=note))
            continue
        sc = CandidateScore(index, name, plan, note=note)
        sig = _signature(plan)
        first = seen.get(sig)
        if first is not None:
            sc.same_as = first.name
            sc.n_collectives, sc.makespan_ms, sc.exposed_ms = first.n_collectives, first.makespan_ms, first.exposed_ms
            sc.peak_bytes, sc.rejected = first.peak_bytes, first.rejected
            scores.append(sc)
            continue
        seen[sig] = sc
        rewritten = (greedy_trial, greedy_after) if name == "greedy" and greedy_trial is not None else None
        scores.append(score_plan(g, dag, plan, options, cost_model, baseline_peak, budget, sc, rewritten=rewritten))

    valid = [s for s in scores if s.makespan_ms is not None and not (s.rejected or s.same_as or s.skipped)]
    if not valid:  # only with a baseline_peak below the graph's own peak: "none" adds nothing to the graph
        fallback = next(s for s in scores if s.name == "none")
        return AutoChoice(plan=fallback.plan, after=None, chosen="none", candidates=scores, scored=True,
                          baseline_peak=baseline_peak, budget_bytes=budget,
                          note="every candidate is over the memory limit: nothing merged")
    best = min(valid, key=CandidateScore.key)
    return AutoChoice(plan=best.plan, after=best.after, chosen=best.name, candidates=scores, scored=True,
                      baseline_peak=baseline_peak, budget_bytes=budget)


__all__ = ["AutoChoice", "CANDIDATES", "CandidateScore", "MAX_SCORED_NODES", "choose_auto_plan", "score_plan"]
