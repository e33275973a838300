"""One graph's memory budget and the rules that keep a bucket plan within it.

``memory_budget`` is extra peak memory the passes may add to a graph, end to end: the FX pass claims part of
it for its buckets (``memory_claim``, a bound from payloads), the scheduler pass's reordering gets the rest.
Everything here reads payloads and module structure only, never activation sizes, so every rank computes
the same budget and splits the same buckets.

The budget's units: bytes, a percentage of the graph's FSDP payload, or blocks.  A block is what one bucket
per module block claims (``block_claim``): the per-block plan's ``memory_claim``, the memory FSDP2 spends to
hold one module's parameters unsharded at a time; ``"2 blocks"`` (the default) is one for bucketing and one
for prefetching.  A graph without repeated blocks (no names, one layer) has no such unit; there a block is
5 % of its payload.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Mapping

from ..bucketing.blocks import merged_block_buckets
from ..bucketing.manual import describe_entries
from ..bucketing.plan import (BUCKETABLE_OPS, Bucket, BucketPlanResult, CollectiveSurvey, cut_to_bound,
                              fsdp_payload_bytes, make_bucket, surveyed)
from ..dag.graph import CollectiveOp, Dag
from ..options import Options

__all__ = ["BucketOverBudget", "MemoryBudget", "block_claim", "fit_to_budget", "graph_memory_budget",
           "memory_claim", "trim_to_budget"]

# the unit of a block-counted budget where a graph has no blocks, as a fraction of its FSDP payload
_NO_BLOCK_FRACTION = 0.05


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
    return kept + sum(_largest_extra_per_kind(buckets, moved_reduction_bytes).values())


def _largest_extra_per_kind(buckets: list[Bucket], moved_reduction_bytes: int = 0) -> dict[CollectiveOp, int]:
    per_kind: dict[CollectiveOp, int] = {CollectiveOp.REDUCE_SCATTER: moved_reduction_bytes}
    for b in buckets:
        per_kind[b.op] = max(per_kind.get(b.op, 0), b.extra_bytes)
    return per_kind


@dataclass(frozen=True)
class MemoryBudget:
    """A graph's budget: ``total`` bytes end to end, and the largest ``extra_bytes_bound`` one bucket of each
    collective kind may have (``bucket_limits``), the total shared among the kinds the graph has in the
    proportions one bucket per block takes (a backward's bf16 re-gathers and fp32 reductions: 1 : 2)."""

    total: int
    bucket_limits: Mapping[CollectiveOp, int] = field(default_factory=dict)

    def limit(self, op: CollectiveOp | None) -> int:
        """Largest ``extra_bytes_bound`` of one bucket of ``op``; a kind the FSDP collectives do not have (a
        non-FSDP all-reduce with ``bucket_non_fsdp``) gets an equal share."""
        if op in self.bucket_limits:
            return self.bucket_limits[op]
        return self.total // max(1, len(self.bucket_limits))


def block_claim(dag: Dag, *, param_fqns: Mapping[str, str] | None = None, bucket_non_fsdp: bool = False,
                survey: CollectiveSurvey | None = None) -> tuple[int, dict[CollectiveOp, int]]:
    """What one bucket per module block claims of the budget (``memory_claim`` of the per-block plan, no
    size cap), and its largest bucket's ``extra_bytes`` per collective kind.  (0, {}) where no block
    bucket merges anything.  ``survey``: ``dag``'s collectives already judged with ``bucket_non_fsdp``."""
    merged = merged_block_buckets(dag, bucket_non_fsdp=bucket_non_fsdp, param_fqns=param_fqns, survey=survey)
    if not merged:
        return 0, {}
    per_kind = {op: n for op, n in _largest_extra_per_kind(merged).items() if n > 0}
    return memory_claim(merged), per_kind


def graph_memory_budget(dag: Dag, options: Options, *, param_fqns: Mapping[str, str] | None = None,
                        survey: CollectiveSurvey | None = None) -> MemoryBudget:
    """``options.memory_budget`` for the graph of ``dag`` (see the module docstring).  ``survey``: ``dag``'s
    collectives already judged with ``options.bucket_non_fsdp`` (``survey_collectives``)."""
    survey = surveyed(dag, options.bucket_non_fsdp, survey)
    payload = fsdp_payload_bytes(dag, survey.collectives)
    unit, per_kind = block_claim(dag, param_fqns=param_fqns, bucket_non_fsdp=options.bucket_non_fsdp, survey=survey)
    if unit == 0:
        unit = int(_NO_BLOCK_FRACTION * payload)
    total = options.memory_budget_bytes(payload, unit)
    kinds = {n.collective for n in dag.nodes if n.fsdp and n.collective in BUCKETABLE_OPS}
    weights = {k: per_kind.get(k, 0) for k in kinds}
    if not all(weights.values()):
        weights = {k: 1 for k in kinds}
    whole = sum(weights.values())
    limits = {k: total * w // whole for k, w in weights.items()}
    return MemoryBudget(total=total, bucket_limits=limits)


def fit_to_budget(dag: Dag, plan: BucketPlanResult, budget: MemoryBudget) -> list[Bucket]:
    """Split the buckets of ``plan`` (in place) until its ``memory_claim`` is within ``budget.total``: a
    bucket over its kind's limit (``bucket_limits``) into pieces within it, then, while the claim is still
    over, the bucket keeping the most bytes to the end into single collectives.  Returns the buckets split
    (as they were).  Rank-invariant: payloads and structure only."""
    split: list[Bucket] = []
    kept: list[Bucket] = []
    for b in plan.buckets:
        limit = budget.limit(b.op)
        if b.extra_bytes <= limit:
            kept.append(b)
            continue
        split.append(b)
        kept.extend(make_bucket(dag, members, close_reason=why or "memory", label=b.label)
                    for members, why in cut_to_bound(dag, b.members, limit))
    while memory_claim(kept) > budget.total:
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


class BucketOverBudget(ValueError):
    """A manual plan's bucket would take the peak over the memory budget (raised with ``strict=True``)."""


def trim_to_budget(dag: Dag, plan: BucketPlanResult, budget: MemoryBudget, *, strict: bool) -> list[str]:
    """Split the buckets of a manual ``plan`` that would take it over ``budget`` (``fit_to_budget``),
    warning with their names, or raise ``BucketOverBudget`` when ``strict``.  Returns the split buckets'
    labels."""
    over = fit_to_budget(dag, plan, budget) if not strict else fit_to_budget(dag, copy.deepcopy(plan), budget)
    if not over:
        return []
    names = [f"{b.label or b.member_names[0]} ({b.op.value}, {len(b)} collectives)" for b in over]
    message = (f"fsdp_passes: bucket_plan buckets {describe_entries(names)} would take the peak over "
               f"memory_budget={budget.total} B")
    if strict:
        raise BucketOverBudget(message + "; raise memory_budget or make the plan finer")
    warnings.warn(message + ": split into smaller buckets", stacklevel=3)
    return [b.label for b in over]
