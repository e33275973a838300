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

and scores each one on an **overlap model** (``score_plan``) that walks the graph once: one compute stream
through the FSDP collectives in graph order, and per process group and direction (gathers, reductions) a
stream on which the buckets run one after another, priced by the cost model.  A gathered parameter's
first use waits for its bucket; a bucket of reductions is issued when its last gradient is ready.  Compute
between two collectives is the larger of

- the launch floor of the kernels Inductor is predicted to run there (``dag.fusion.predict_kernels``, one
  empty kernel's time each: on a small model this is most of the step, and hides small collectives), and
- a stand-in for the FLOPs the score may not read: a parameter's (gradient's) transfer time at the link's
  full bandwidth (the cost model's marginal time per byte of a large message) after its first use (before
  its reduction), the point where overlap is just possible;

and a merged bucket adds its copy kernels to the compute stream (a gather: one kernel copying every member's
shard in before the issue and one copying all members out before the first use of any, ``bucketing.rewrite``'s
``copy_in_members`` and ``copy_out_members``; a reduction: each member copied into its slice of a
``bucket_cat``, the reduced shards are views).  A reduction member whose input is computed for it alone by
pointwise ops (a cast of a gradient to ``reduce_dtype``) has no copy of its own: Inductor computes that input
straight into the merged buffer (``dag.fusion.copy_fuses_with_producer``), a kernel every candidate runs.
``CandidateScore.copy_ms`` is what the copies add.  So the score weighs what bucketing trades: a latency saved
per merged collective against the copies it adds and a larger first (gathers) or last (reductions) bucket that
nothing hides.  What overlapping costs (``CostModel.overlap_costs``, as in the simulator) applies too: each
issue holds the compute stream for the profile's issue time, and compute runs slower while a collective is in
flight.  With ``reorder`` on, gathers are issued ahead of their use (prefetch), in order, as their stream
allows and while the gathered bytes issued and not yet used fit in what the candidate leaves of the memory
budget (its claim taken: the reordering gets only the rest, so a candidate claiming the whole budget is
gathered when needed); with it off, when first needed.  Score: modelled makespan, then exposed communication,
then fewer collectives, then the candidate's index; makespans within ``SCORE_RESOLUTION`` (2 %) of the best
count as equal, and the fewest collectives win among them.

The score reads the FSDP collectives (op, group, payload, dtype), their order, the graph's structure (how many
kernels run between them), the module structure, the options and the cluster profile; no FLOP count or
activation size, which differ between ranks with different local batches.  One caveat: the kernel prediction
decides some fusions by comparing loop sizes (a kernel looping over a weight fuses with one looping over
activations only when their element counts are equal), so a kernel count can depend on the local batch where
such sizes happen to tie, and a local batch of 1
changes layouts (a ``reshape`` of a transposed activation is a view when the batch dimension is 1, a copy kernel
otherwise; a sum over a batch dimension of 1 counts as pointwise, not as a reduction).  Such a difference moves
a stretch's launch floor by one empty kernel, which changes the choice only where two candidates sit at the
``SCORE_RESOLUTION`` boundary;
tests/pipeline/test_rank_invariance.py holds the final collective sequences equal across local batches that
include such ties (batch = model width), not every model and batch.  It costs one kernel prediction per graph
and O(collectives) per candidate: no graph is rewritten or simulated.

Memory: every candidate is fitted to the budget (``fit_to_budget``), so its rank-invariant claim on it
(``memory_claim``) is within ``memory_budget``; a candidate over it (never one of these four) is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..bucketing.blocks import plan_per_block, plan_unmerged
from ..bucketing.plan import BucketPlanResult, CollectiveSurvey
from ..bucketing.rewrite import gathered_into_own_buffer
from ..dag.collectives import KINDS
from ..dag.graph import CollectiveOp, Dag
from ..dag.fusion import copy_fuses_with_producer
from ..simulate import slowed_end
from .budget import MemoryBudget, fit_to_budget, memory_claim

CANDIDATES = ("greedy", "per_block", "none", "greedy_half_cap")

# ms: makespans / exposed times closer than this count as equal, so the tie-breaks decide
_TIE_MS = 1e-6

#: candidates whose modelled makespan is within this fraction of the best one's count as equally fast, and
#: the one with the fewest collectives wins among them: the score does not see which copy-outs Inductor
#: fuses into their readers, nor the compute its stand-in replaces (on the third-party test models its
#: makespans are 1-5 % off the final schedule's), and every collective more costs an issue and a latency floor
#: for certain
SCORE_RESOLUTION = 0.02

# bytes: a message large enough to run at the link's full bandwidth (for the compute model of score_plan)
_LARGE = 1 << 30


def _signature(plan: BucketPlanResult) -> tuple:
    return tuple(sorted(tuple(b.members) for b in plan.buckets if len(b) > 1))


# -- scoring ---------------------------------------------------------------------------------------------------

@dataclass
class CandidateScore:
    """One candidate plan and its overlap model figures (times in ms, memory in bytes)."""

    index: int
    name: str
    plan: BucketPlanResult = field(repr=False)
    n_collectives: int = 0
    makespan_ms: float | None = None
    exposed_ms: float | None = None
    extra_bytes: int | None = None  # memory_claim of the plan
    copy_ms: float | None = None  # the merges' copy kernels on the compute stream, at full speed
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
            "copy_ms": self.copy_ms,
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
    memory_budget_bytes: int  # the graph's memory budget, bytes
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "chosen": self.chosen,
            "memory_budget_bytes": self.memory_budget_bytes,
            "score": (f"overlap model: makespan (within {SCORE_RESOLUTION:.0%} of the best counts as equal), "
                      "then fewer collectives, exposed comm, index"),
            "candidates": [c.to_json() for c in self.candidates],
        }
        if self.note:
            out["note"] = self.note
        return out


@dataclass
class GraphStructure:
    """What the score knows of a graph's compute, from its structure only: the launch floor of the kernels
    Inductor is predicted to run (``dag.fusion.predict_kernels``) as prefix sums over the FX DAG's node
    positions (``floor_ms[i]``: kernels at positions before ``i``), and the time of an empty kernel."""

    floor_ms: list[float]
    launch_ms: float

    @classmethod
    def of(cls, dag: Dag, cost_model: Any, kernels: Dag | None = None) -> "GraphStructure":
        """kernels: ``predict_kernels(dag)`` if already computed (while ``dag``'s FX graph is unchanged)."""
        import torch.fx as fx

        from ..dag.fusion import predict_kernels
        from ..dag.graph import NodeKind

        launch = float(cost_model.compute_ms(0.0, 0.0))
        per_position = [0.0] * (len(dag) + 1)
        for kernel in (predict_kernels(dag) if kernels is None else kernels).nodes:
            if kernel.kind is not NodeKind.COMPUTE or not kernel.launches_kernel:
                continue
            name = kernel.origin.name if isinstance(kernel.origin, fx.Node) else kernel.name
            position = dag.index.get(name)
            if position is not None:
                per_position[position] += launch
        floor, total = [0.0], 0.0
        for t in per_position:
            total += t
            floor.append(total)
        return cls(floor_ms=floor, launch_ms=launch)

    def between(self, a: int, b: int) -> float:
        """Launch floor of the kernels at positions ``a <= i < b``."""
        return self.floor_ms[max(b, a)] - self.floor_ms[a]


@dataclass
class _ComputeClock:
    """The compute stream's time in the score, and how long it has been busy (issuing, copying, computing)
    rather than waiting for a collective."""

    now: float = 0.0
    busy: float = 0.0

    def advance(self, start: float, end: float) -> None:
        """The stream worked from ``start`` to ``end`` (``start`` is later than ``now`` when it waited)."""
        self.busy += end - start
        self.now = end


def score_plan(dag: Dag, plan: BucketPlanResult, options: Any, cost_model: Any, budget: MemoryBudget,
               score: CandidateScore, structure: GraphStructure | None = None) -> CandidateScore:
    """Fill ``score`` with the overlap model's figures for ``plan`` (see the module docstring).

    Collectives the plan leaves out (``unbucketed``) are scored alone; only bucketable ones are in a plan,
    and the others are the same in every candidate."""
    if structure is None:
        structure = GraphStructure.of(dag, cost_model)
    units: list[tuple[list[int], CollectiveOp | None]] = [(list(b.members), b.op) for b in plan.buckets]
    units.extend(([c], dag.nodes[c].collective) for c in plan.unbucketed)
    score.n_collectives = len(units)
    # only FSDP collectives are modelled: their payloads are parameter-sized, the same on every rank (a
    # tensor-parallel all-reduce of activations is not, and is the same in every candidate anyway)
    units = [u for u in units if dag.nodes[u[0][0]].fsdp]
    score.extra_bytes = memory_claim(plan.buckets)
    if score.extra_bytes > budget.total:
        score.rejected = f"memory claim {score.extra_bytes} B > memory_budget {budget.total} B"
        return score

    priced: dict[tuple, float] = {}  # a block's collectives repeat the same few (op, bytes, group)

    def cost(op: CollectiveOp | None, nbytes: int, node: Any) -> float:
        key = (op, nbytes, node.group_size, node.group_ranks)
        ms = priced.get(key)
        if ms is None:
            ms = priced[key] = float(cost_model.collective_ms(op or CollectiveOp.OTHER, nbytes,
                                                              node.group_size or 2, node.group_ranks))
        return ms

    def copy_ms(nbytes: float) -> float:  # one copy kernel: reads and writes ``nbytes``
        return float(cost_model.compute_ms(0.0, 2.0 * nbytes))

    # per unit: its stream (group, direction), its cost, and the compute its merge adds (copy kernels)
    stream_of: list[tuple[str, bool]] = []
    comm_ms: list[float] = []
    copy_in: list[float] = []  # on the compute stream before the issue
    copy_out: list[float] = []  # on the compute stream before the first use of any member (gathers)
    unit_bytes: list[int] = []
    owner: dict[int, int] = {}
    for k, (members, op) in enumerate(units):
        first = dag.nodes[members[0]]
        is_gather = op is not None and not KINDS[op].reduces
        total = sum(dag.nodes[m].comm_bytes for m in members)
        stream_of.append((first.group_name or "?", is_gather))
        comm_ms.append(cost(op, total, first))
        merged = len(members) > 1
        shard = max(first.group_size or 1, 1)
        if is_gather:
            # a merged gather: the members' shards copied in by one kernel; every member copied out of the
            # merged buffer by one kernel, before the first use of any of them, and a 1-D member once more into a
            # buffer of its own (bucketing.rewrite.gathered_into_own_buffer)
            own = [m for m in members if gathered_into_own_buffer(dag.nodes[m].origin)]
            copy_in.append(copy_ms(total / shard) if merged else 0.0)
            copy_out.append(copy_ms(total) + sum(copy_ms(dag.nodes[m].comm_bytes) for m in own) if merged else 0.0)
        else:
            # a merged reduction: each member copied into the flat input, unless a pointwise kernel computes
            # its input for it alone (a cast to reduce_dtype): computed straight into the flat input, that
            # kernel runs in every candidate; the reduced shards are views of the output (no kernel)
            own_copy = [m for m in members if not copy_fuses_with_producer(dag, m)] if merged else []
            copy_in.append(sum(copy_ms(dag.nodes[m].comm_bytes) for m in own_copy))
            copy_out.append(0.0)
        unit_bytes.append(total)
        for m in members:
            owner[m] = k

    score.copy_ms = sum(copy_in) + sum(copy_out)

    # compute standing in for the FLOPs the score may not read: a member's transfer at the link's full
    # bandwidth (the marginal cost per byte of a large message), after a gathered parameter's first use and
    # before a gradient's reduction; between two collectives at least the kernels' launch floor
    def balanced(m: int) -> float:
        node = dag.nodes[m]
        per_byte = (cost(node.collective, 2 * _LARGE, node) - cost(node.collective, _LARGE, node)) / _LARGE
        return max(0.0, per_byte) * node.comm_bytes

    events = sorted(owner)  # FSDP members in graph order
    gather = [stream_of[owner[m]][1] for m in events]
    stream_free: dict[tuple[str, bool], float] = {}
    done = [0.0] * len(units)
    issued = [False] * len(units)
    overlap = cost_model.overlap_costs()

    def run(now: float, work: float) -> float:
        """End of ``work`` ms of compute started at ``now``, slowed while a collective is in flight."""
        return slowed_end(now, work, max(stream_free.values(), default=0.0), overlap.compute_slowdown)

    def issue(k: int, now: float) -> float:
        """Issue unit ``k`` at ``now`` on the compute stream: its copy-in, then the collective (the host busy
        issuing it) on its stream.  Returns the compute stream's time after the issue."""
        now = run(now, copy_in[k]) + overlap.issue_ms
        start = max(now, stream_free.get(stream_of[k], 0.0))
        stream_free[stream_of[k]] = done[k] = start + comm_ms[k]
        issued[k] = True
        return now

    # prefetch (reorder on): gather buckets are issued ahead of their use, in order, while the gathered bytes
    # issued and not yet used fit in what the plan leaves of the memory budget (the reordering gets only that:
    # a plan claiming the whole budget is gathered when needed)
    room = max(0, budget.total - score.extra_bytes) if options.reorder else -1
    ahead = sorted({owner[m] for m in events if stream_of[owner[m]][1]}, key=lambda k: min(units[k][0]))
    next_ahead = 0
    held = 0  # bytes of gather buckets issued and not yet used

    def prefetch(now: float) -> float:
        nonlocal next_ahead, held
        while next_ahead < len(ahead):
            k = ahead[next_ahead]
            if not issued[k]:
                if held + unit_bytes[k] > room:
                    break
                now = issue(k, now)
                held += unit_bytes[k]
            next_ahead += 1
        return now

    clock = _ComputeClock()
    clock.advance(clock.now, prefetch(clock.now))
    remaining = {k: len(members) for k, (members, _) in enumerate(units)}
    used: set[int] = set()
    previous = 0
    for e, m in enumerate(events):
        k = owner[m]
        # compute from the previous collective to this one: launch floor, or the balanced stand-in of the
        # gradient produced here and the parameter used since the previous collective
        region = structure.between(previous, m)
        stand_in = (balanced(m) if not gather[e] else 0.0) + (
            balanced(events[e - 1]) if e > 0 and gather[e - 1] else 0.0)
        clock.advance(clock.now, run(clock.now, max(region, stand_in)))
        previous = m
        if gather[e]:
            if not issued[k]:  # not prefetched: issued when first needed
                clock.advance(clock.now, issue(k, clock.now))
            elif k not in used:
                held -= unit_bytes[k]
            ready = max(clock.now, done[k])  # the compute stream waits for the gathered bucket
            clock.advance(ready, run(ready, copy_out[k] if k not in used else 0.0))  # the first use copies out
            used.add(k)
            if options.reorder:  # its room is free for the next buckets
                clock.advance(clock.now, prefetch(clock.now))
        else:
            remaining[k] -= 1
            if remaining[k] == 0:  # the last gradient of the bucket is ready
                clock.advance(clock.now, issue(k, clock.now))
    tail = max(structure.between(previous, len(dag)),
               balanced(events[-1]) if events and gather[-1] else 0.0)
    clock.advance(clock.now, run(clock.now, tail))
    makespan = max([clock.now, *done])
    score.makespan_ms, score.exposed_ms = makespan, makespan - clock.busy
    return score


def choose_auto_plan(dag: Dag, options: Any, cost_model: Any, budget: MemoryBudget, *,
                     param_fqns: Mapping[str, str] | None = None, kernels: Dag | None = None,
                     survey: CollectiveSurvey | None = None) -> AutoChoice:
    """Build the candidates for ``dag``, score them, return the best (see the module docstring).

    budget: ``memory_budget`` for this graph (``budget.graph_memory_budget``).
    kernels: ``dag.fusion.predict_kernels(dag)`` if the caller has it (computed here otherwise).
    survey: ``dag``'s collectives judged with ``options.bucket_non_fsdp`` (``bucketing.plan.survey_collectives``)
        if the caller has them (judged here otherwise, once for every candidate)."""
    from ..bucketing.auto import plan_auto
    from ..bucketing.plan import break_cycles, surveyed

    survey = surveyed(dag, options.bucket_non_fsdp, survey)

    limit = budget.limit
    cap_bytes = None if options.bucket_cap_mb is None else int(options.bucket_cap_mb * 2**20)

    def greedy(cap_mb: float | None) -> BucketPlanResult:
        return break_cycles(dag, plan_auto(dag, cost_model, bucket_cap_mb=cap_mb, extra_bytes_limit=limit,
                                           bucket_non_fsdp=options.bucket_non_fsdp, survey=survey))

    greedy_plan = greedy(options.bucket_cap_mb)
    per_block = break_cycles(dag, plan_per_block(dag, bucket_non_fsdp=options.bucket_non_fsdp,
                                                 param_fqns=param_fqns, cap_bytes=cap_bytes,
                                                 extra_bytes_limit=limit, survey=survey))
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

    structure = GraphStructure.of(dag, cost_model, kernels)
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
            sc.extra_bytes, sc.rejected, sc.copy_ms = first.extra_bytes, first.rejected, first.copy_ms
            scores.append(sc)
            continue
        seen[sig] = sc
        scores.append(score_plan(dag, plan, options, cost_model, budget, sc, structure))

    valid = [s for s in scores if s.makespan_ms is not None and not (s.rejected or s.same_as or s.skipped)]
    fastest = min(valid, key=CandidateScore.key)  # "none" claims nothing: never rejected
    near = [s for s in valid if s.makespan_ms <= fastest.makespan_ms * (1.0 + SCORE_RESOLUTION)]
    best = min(near, key=lambda s: (s.n_collectives, s.key()))
    return AutoChoice(plan=best.plan, chosen=best.name, candidates=scores, memory_budget_bytes=budget.total)


__all__ = ["AutoChoice", "CANDIDATES", "CandidateScore", "GraphStructure", "choose_auto_plan", "score_plan"]
