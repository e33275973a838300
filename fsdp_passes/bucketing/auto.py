"""The cost-model bucket planner (``bucketing="auto"``'s greedy candidate).

A pure function of the collectives (op, process group, payload, dtype), the graph's dependencies, the options
and the cluster profile: nothing that depends on activation sizes (compute time, activation memory) enters,
so every rank plans the same buckets whatever its local batch, sequence length or size hints.  See
docs/bucketing.md for the algorithm in prose; in short, for every sequence of bucketable collectives sharing
(op, process group, reduce op, dtype, group size), in graph order, grow one bucket at a time and add the next
collective while all of these hold:

1. it does not depend on a member's result (forward taint over the bucket's id window);
2. the merged payload stays within ``bucket_cap_mb``;
3. the bucket's rank-invariant memory bound (``plan.extra_bytes_bound``) stays within ``extra_bytes_limit``;
4. one merged collective is cheaper than two (``cost(a + b) < cost(a) + cost(b)``).

Whether a bucket can still be hidden under compute is judged afterwards, among whole plans
(``choice.choose_auto_plan``).  Linear: each sequence is scanned once, and each bucket's dependency window is
scanned once (O(K · (V + E)) for K sequences, a handful in practice).
"""

from __future__ import annotations

from typing import Protocol

from ..dag.graph import CollectiveOp, Dag
from .plan import (Bucket, BucketKey, BucketLimit, BucketPlanResult, CollectiveSurvey, GrowingBucket, bucket_limit,
                   make_bucket, surveyed)


class CollectiveCost(Protocol):
    def collective_ms(self, op: CollectiveOp, nbytes: int, group_size: int, group_ranks=None) -> float: ...


def plan_auto(
    dag: Dag,
    cost_model: CollectiveCost,
    *,
    bucket_cap_mb: float | None = None,
    extra_bytes_limit: BucketLimit = None,
    bucket_non_fsdp: bool = False,
    survey: CollectiveSurvey | None = None,
) -> BucketPlanResult:
    """Greedy buckets per (op, group, reduce op, dtype) sequence; see the module docstring.

    bucket_cap_mb: largest merged payload, MiB (None: no cap).
    extra_bytes_limit: largest ``extra_bytes_bound`` of one bucket (a share of the graph's memory budget,
        ``budget.MemoryBudget.limit``), or a function of the bucket's op giving it (None: no limit).
    survey: ``dag``'s collectives already judged with ``bucket_non_fsdp`` (``survey_collectives``), else
        judged here.
    """
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}: expected a positive number of MiB or None")
    if isinstance(extra_bytes_limit, int) and extra_bytes_limit < 0:
        raise ValueError(f"extra_bytes_limit={extra_bytes_limit!r} bytes: expected >= 0")
    cap_bytes = None if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)

    survey = surveyed(dag, bucket_non_fsdp, survey)
    sequences: dict[BucketKey, list[int]] = {}
    for c, key in survey.keys.items():
        sequences.setdefault(key, []).append(c)

    buckets: list[Bucket] = []
    for key, seq in sequences.items():
        buckets.extend(_plan_sequence(dag, seq, cost_model, cap_bytes,
                                      bucket_limit(extra_bytes_limit, dag.nodes[seq[0]].collective), key))
    buckets.sort(key=lambda b: b.members[0])
    return BucketPlanResult(buckets=buckets, unbucketed=dict(survey.unbucketed),
                            n_collectives_before=len(survey.collectives))


def _plan_sequence(dag: Dag, seq: list[int], cm: CollectiveCost, cap_bytes: int | None, limit: int | None,
                   key: tuple) -> list[Bucket]:
    bucket = GrowingBucket(dag, seq[0])
    op, group_size, ranks = bucket.op, bucket.group_size, dag.nodes[seq[0]].group_ranks
    label = f"auto:{key[0]}:{key[1]}:{key[3]}"
    cache: dict[int, float] = {}

    def cost(nbytes: int) -> float:
        v = cache.get(nbytes)
        if v is None:
            v = float(cm.collective_ms(op, nbytes, group_size, ranks))
            cache[nbytes] = v
        return v

    out: list[Bucket] = []
    for j in seq[1:]:
        bj = dag.nodes[j].comm_bytes
        if bucket.depends_on_member(j):
            reason = "dependency"
        else:
            reason = bucket.over_bound(j, cap_bytes, limit)
            if reason is None and not cost(bucket.total + bj) < cost(bucket.total) + cost(bj):
                reason = "latency"
        if reason is None:
            bucket.add(j)
        else:
            out.append(make_bucket(dag, bucket.members, close_reason=reason, label=label))
            bucket.restart(j)
    out.append(make_bucket(dag, bucket.members, close_reason="end", label=label))
    return out
