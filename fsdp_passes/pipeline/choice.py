"""``bucketing="auto"``: choose among a few candidate plans by a rank-invariant model of how they overlap.

The greedy planner (``auto.py``) merges as long as merging is cheaper and the memory bound allows; whether
a bucket can still be hidden under compute is a question about whole plans: a single bucket of every
forward gather cannot be prefetched under anything and exposes its whole transfer.  So
``choose_auto_plan`` builds at most four candidates on the DAG:

0. ``greedy``: the greedy plan;
1. ``per_block``: one bucket per module block per (op, group, reduce op, dtype): collectives are grouped by
   the top-level repeated module prefix (``layers.<i>``, ``model.layers.<i>``: the FQN up to its first
   integer component, where that prefix holds at least two indices); everything else by its top-level
   module (``tok_embeddings``, ``norm``, ``output``), each its own bucket;
2. ``none``: no merging;
3. ``greedy_half_cap``: greedy with the size cap at half the bytes of the largest block bucket (only when
   that changes the greedy plan),

and scores each one on the **balanced-overlap model** (``score_plan``): per process group and direction
(gathers, reductions), the buckets run one after another on the group's stream, priced by the cost model;
the compute that uses a gathered parameter (or produces a gradient) is assumed to last as long as moving
that tensor at the link's full bandwidth (the cost model's marginal time per byte of a large message).  That is
the point where overlap is just possible, so the score weighs what bucketing trades: a latency saved per
merged collective against a larger first (gathers) or last (reductions) bucket that nothing hides.  With
``reorder`` on, gathers are issued as early as the stream allows (prefetch); with it off, when first
needed.  Score: modelled makespan, then exposed communication, then fewer collectives, then the
candidate's index.

Everything the score reads is rank-invariant: the FSDP collectives (op, group, payload, dtype), their
order, the module structure, the options and the cluster profile; no compute estimate or activation size, which
differ between ranks with different local batches.  So every rank chooses the same plan.  It costs
O(collectives) per candidate: no graph is rewritten or simulated.

Memory: every candidate is fitted to the budget (``fit_to_budget``), so its rank-invariant claim on it
(``memory_claim``) is within ``memory_budget``; a candidate over it (never one of these four) is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..bucketing.blocks import plan_per_block, plan_unmerged
from ..bucketing.plan import Bucket, BucketPlanResult, cut_to_bound, make_bucket
from ..dag.graph import CollectiveOp, Dag

CANDIDATES = ("greedy", "per_block", "none", "greedy_half_cap")

# ms: makespans / exposed times closer than this count as equal, so the tie-breaks decide
_TIE_MS = 1e-6

_REDUCTIONS = (CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE)

# bytes: a message large enough to run at the link's full bandwidth (for the compute model of score_plan)
_LARGE = 1 << 30


def _signature(plan: BucketPlanResult) -> tuple:
    return tuple(sorted(tuple(b.members) for b in plan.buckets if len(b) > 1))


# -- memory claim ----------------------------------------------------------------------------------------------

def memory_claim(buckets: list[Bucket], moved_reduction_bytes: int = 0) -> int:
    """The part of ``memory_budget`` a plan may use, from payloads only: every bucket's ``kept_bytes``, plus,
    per collective kind (all-gather, reduce-scatter, all-reduce), the largest ``extra_bytes`` of its buckets;
    the reduce-scatter part is at least the payload of the reductions moved behind a re-gather
    (``moved_reduction_bytes``: their inputs stay alive while the gather's output exists).

    Buckets of one kind run one after another (the next gather bucket is issued after the previous one's
    members are in use), so only the largest of a kind counts; buckets of different kinds (a backward's
    gathers and reduce-scatters, HSDP's all-reduces on the replicate group) can be in flight together, so the
    kinds add; what is kept to the end adds up."""
    kept = sum(b.kept_bytes for b in buckets)
    per_kind: dict[CollectiveOp, int] = {CollectiveOp.REDUCE_SCATTER: moved_reduction_bytes}
    for b in buckets:
        per_kind[b.op] = max(per_kind.get(b.op, 0), b.extra_bytes)
    return kept + sum(per_kind.values())


def fit_to_budget(dag: Dag, plan: BucketPlanResult, budget: int) -> list[Bucket]:
    """Split the buckets of ``plan`` (in place) until its ``memory_claim`` is within ``budget``: a bucket over
    the per-bucket limit (``memory_limits``) into pieces within it, then, while the claim is still over,
    the bucket keeping the most bytes to the end into single collectives.  Returns the buckets split (as
    they were).  Rank-invariant: payloads and structure only."""
    limit = memory_limits(dag, budget)
    split: list[Bucket] = []
    kept: list[Bucket] = []
    for b in plan.buckets:
        if b.extra_bytes <= limit:
            kept.append(b)
            continue
        split.append(b)
        kept.extend(make_bucket(dag, members, close_reason=why or "memory", label=b.label)
                    for members, why in cut_to_bound(dag, b.members, limit))
    while memory_claim(kept) > budget:
        victim = max((b for b in kept if b.kept_bytes > 0), key=lambda b: (b.kept_bytes, -b.members[0]),
                     default=None)
        if victim is None:
            break
        kept.remove(victim)
        split.append(victim)
        kept.extend(make_bucket(dag, [m], close_reason="memory", label=victim.label) for m in victim.members)
    if split:
        kept.sort(key=lambda x: x.members[0])
        plan.buckets = kept
    return split


def memory_limits(dag: Dag, budget: int) -> int:
    """Largest ``extra_bytes_bound`` one bucket may have so that ``memory_claim`` stays within ``budget``: the
    budget divided by the number of kinds of FSDP collectives in the graph (a forward's gathers: the whole
    budget; a backward's re-gathers and reduce-scatters: half each)."""
    fsdp_ops = (CollectiveOp.ALL_GATHER, *_REDUCTIONS)
    kinds = {n.collective for n in dag.nodes if n.fsdp and n.collective in fsdp_ops}
    return budget // max(1, len(kinds))


# -- scoring ---------------------------------------------------------------------------------------------------

@dataclass
class CandidateScore:
    """One candidate plan and its balanced-overlap model figures (times in ms, memory in bytes)."""

    index: int
    name: str
    plan: BucketPlanResult = field(repr=False)
    n_collectives: int = 0
    makespan_ms: float | None = None
    exposed_ms: float | None = None
    extra_bytes: int | None = None  # memory_claim of the plan
    rejected: str | None = None  # why it cannot be chosen (over the memory budget); None if it can
    skipped: str | None = None  # why it was not built (e.g. the greedy plan is already that small)
    same_as: str | None = None  # an earlier candidate with the same buckets (not scored again)
    note: str | None = None

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
            "extra_bytes": self.extra_bytes,
            "rejected": self.rejected,
        }
        for k in ("skipped", "same_as", "note"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out


@dataclass
class AutoChoice:
    """What ``choose_auto_plan`` decided: the winning plan and why."""

    plan: BucketPlanResult
    chosen: str
    candidates: list[CandidateScore]
    budget_bytes: int
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "chosen": self.chosen,
            "memory_budget_bytes": self.budget_bytes,
            "score": "balanced-overlap model: makespan, then exposed comm, then fewer collectives, then index",
            "candidates": [c.to_json() for c in self.candidates],
        }
        if self.note:
            out["note"] = self.note
        return out


def score_plan(dag: Dag, plan: BucketPlanResult, options: Any, cost_model: Any, budget: int,
               score: CandidateScore) -> CandidateScore:
    """Fill ``score`` with the balanced-overlap model's figures for ``plan`` (see the module docstring).

    Collectives the plan leaves out (``unbucketed``) are scored alone; only bucketable ones are in a plan,
    and the others are the same in every candidate."""
    units: list[tuple[list[int], CollectiveOp | None]] = [(list(b.members), b.op) for b in plan.buckets]
    units.extend(([c], dag.nodes[c].collective) for c in plan.unbucketed)
    score.n_collectives = len(units)
    # only FSDP collectives are modelled: their payloads are parameter-sized, the same on every rank (a
    # tensor-parallel all-reduce of activations is not, and is the same in every candidate anyway)
    units = [u for u in units if dag.nodes[u[0][0]].fsdp]
    score.extra_bytes = memory_claim(plan.buckets)
    if score.extra_bytes > budget:
        score.rejected = f"memory claim {score.extra_bytes} B > memory_budget {budget} B"
        return score

    def cost(op: CollectiveOp | None, nbytes: int, node: Any) -> float:
        return float(cost_model.collective_ms(op or CollectiveOp.OTHER, nbytes, node.group_size or 2,
                                              node.group_ranks))

    streams: dict[tuple[str, bool], list[tuple[list[int], float]]] = {}
    for members, op in units:
        first = dag.nodes[members[0]]
        is_gather = op is not None and op not in _REDUCTIONS
        total = sum(dag.nodes[m].comm_bytes for m in members)
        streams.setdefault((first.group_name or "?", is_gather), []).append((members, cost(op, total, first)))
    makespan = exposed = 0.0
    for (_, is_gather), seq in streams.items():
        # compute per member: its transfer time at the link's full bandwidth (the marginal cost per byte of a
        # large message: neither the latency nor the poorer bandwidth of small messages)
        slot: dict[int, float] = {}
        for members, _ in seq:
            for m in members:
                node = dag.nodes[m]
                per_byte = (cost(node.collective, 2 * _LARGE, node) - cost(node.collective, _LARGE, node)) / _LARGE
                slot[m] = max(0.0, per_byte) * node.comm_bytes
        order = sorted(slot)
        busy = sum(slot.values())
        if is_gather:
            seq.sort(key=lambda u: u[0][0])
            owner = {m: k for k, (members, _) in enumerate(seq) for m in members}
            done = [0.0] * len(seq)
            issued = [False] * len(seq)
            stream = end = 0.0
            if options.reorder:  # prefetch: every bucket as early as the stream allows
                for k, (_, c) in enumerate(seq):
                    stream = done[k] = stream + c
                    issued[k] = True
            for m in order:
                k = owner[m]
                if not issued[k]:  # no prefetch: issued when first needed
                    stream = done[k] = max(stream, end) + seq[k][1]
                    issued[k] = True
                end = max(end, done[k]) + slot[m]
            span = end
        else:
            seq.sort(key=lambda u: u[0][-1])
            produced, t = {}, 0.0
            for m in order:
                t += slot[m]
                produced[m] = t
            stream = 0.0
            for members, c in seq:
                stream = max(stream, produced[members[-1]]) + c
            span = max(t, stream)
        makespan += span
        exposed += span - busy
    score.makespan_ms, score.exposed_ms = makespan, exposed
    return score


def choose_auto_plan(dag: Dag, options: Any, cost_model: Any, budget: int, *,
                     param_fqns: Mapping[str, str] | None = None) -> AutoChoice:
    """Build the candidates for ``dag``, score them, return the best (see the module docstring).

    budget: ``memory_budget`` in bytes for this graph (``bucket_graph`` takes it of the FSDP payload)."""
    from ..bucketing.auto import plan_auto
    from ..bucketing.plan import break_cycles

    limit = memory_limits(dag, budget)
    cap_bytes = None if options.bucket_cap_mb is None else int(options.bucket_cap_mb * 2**20)

    def greedy(cap_mb: float | None) -> BucketPlanResult:
        return break_cycles(dag, plan_auto(dag, cost_model, bucket_cap_mb=cap_mb, memory_budget_bytes=limit,
                                           bucket_non_fsdp=options.bucket_non_fsdp))

    greedy_plan = greedy(options.bucket_cap_mb)
    per_block = break_cycles(dag, plan_per_block(dag, bucket_non_fsdp=options.bucket_non_fsdp,
                                                 param_fqns=param_fqns, cap_bytes=cap_bytes,
                                                 memory_budget_bytes=limit))
    fit_to_budget(dag, greedy_plan, budget)
    fit_to_budget(dag, per_block, budget)
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
        half_plan = greedy(cap_mb)
        fit_to_budget(dag, half_plan, budget)
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
            sc.extra_bytes, sc.rejected = first.extra_bytes, first.rejected
            scores.append(sc)
            continue
        seen[sig] = sc
        scores.append(score_plan(dag, plan, options, cost_model, budget, sc))

    valid = [s for s in scores if s.makespan_ms is not None and not (s.rejected or s.same_as or s.skipped)]
    best = min(valid, key=CandidateScore.key)  # "none" claims nothing: never rejected
    return AutoChoice(plan=best.plan, chosen=best.name, candidates=scores, budget_bytes=budget)


__all__ = ["AutoChoice", "CANDIDATES", "CandidateScore", "choose_auto_plan", "fit_to_budget", "memory_claim",
           "memory_limits", "score_plan"]
