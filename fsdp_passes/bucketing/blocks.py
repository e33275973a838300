"""Candidate plans for ``bucketing="auto"`` beside the greedy one: one bucket per module block, and no merging.

``fsdp_passes.pipeline.choice`` scores them against the greedy plan and picks one.
"""

from __future__ import annotations

from typing import Mapping

from ..dag.graph import Dag
from .manual import collective_fqn
from .plan import (Bucket, BucketLimit, BucketPlanResult, bucket_key, bucket_limit, bucketability, cut_to_bound,
                   make_bucket, split_dependent)

__all__ = ["block_keys", "plan_per_block", "plan_unmerged"]


def _first_index(parts: list[str]) -> int | None:
    for k in range(1, len(parts) - 1):
        if parts[k].isdigit():
            return k
    return None


def block_keys(fqns: Mapping[int, str | None]) -> dict[int, str | None]:
    """Collective id -> its block: ``<prefix>.<i>`` where the FQN's first integer component ``i`` follows a
    prefix that holds at least two indices among ``fqns`` (a repeated module list); else the FQN's top-level
    module; None without an FQN."""
    indices: dict[str, set[str]] = {}
    for fqn in fqns.values():
        if fqn:
            parts = fqn.split(".")
            k = _first_index(parts)
            if k is not None:
                indices.setdefault(".".join(parts[:k]), set()).add(parts[k])
    out: dict[int, str | None] = {}
    for c, fqn in fqns.items():
        if not fqn:
            out[c] = None
            continue
        parts = fqn.split(".")
        k = _first_index(parts)
        if k is not None and len(indices.get(".".join(parts[:k]), ())) >= 2:
            out[c] = ".".join(parts[: k + 1])
        else:
            out[c] = parts[0]
    return out


def plan_per_block(dag: Dag, *, bucket_non_fsdp: bool = False, param_fqns: Mapping[str, str] | None = None,
                   cap_bytes: int | None = None, memory_budget_bytes: BucketLimit = None) -> BucketPlanResult:
    """One bucket per module block (see ``block_keys``) per (op, group, reduce op, dtype, group size).

    Members that depend on each other are split into runs (``close_reason="dependency"``).  A run is cut
    where the next member would take it over ``cap_bytes`` (``"size_cap"``) or its ``extra_bytes_bound`` over
    ``memory_budget_bytes`` (``"memory"``), so both candidates obey the same per-bucket limits.  Collectives
    without an FQN stay alone.
    """
    collectives = dag.collectives()
    unbucketed: dict[int, str] = {}
    fqns: dict[int, str | None] = {}
    for c in collectives:
        why = bucketability(dag, c, bucket_non_fsdp=bucket_non_fsdp)
        if why:
            unbucketed[c] = why
        else:
            fqns[c] = collective_fqn(dag.nodes[c], param_fqns)
    blocks = block_keys(fqns)
    groups: dict[tuple, list[int]] = {}
    buckets: list[Bucket] = []
    for c in fqns:  # graph order
        block = blocks[c]
        if block is None:
            buckets.append(make_bucket(dag, [c], close_reason="plan", label="block:?"))
        else:
            groups.setdefault((block, bucket_key(dag.nodes[c])), []).append(c)
    for (block, _), members in groups.items():
        label = f"block:{block}"
        runs = split_dependent(dag, members)
        for r_idx, run in enumerate(runs):
            for piece, why in cut_to_bound(dag, run, bucket_limit(memory_budget_bytes, dag.nodes[run[0]].collective),
                                           cap_bytes):
                if why is None:
                    why = "dependency" if r_idx < len(runs) - 1 else "plan"
                buckets.append(make_bucket(dag, piece, close_reason=why, label=label))
    buckets.sort(key=lambda b: b.members[0])
    return BucketPlanResult(buckets=buckets, unbucketed=unbucketed, n_collectives_before=len(collectives))


def plan_unmerged(dag: Dag, like: BucketPlanResult, reason: str = "score") -> BucketPlanResult:
    """``like``'s collectives, each alone (same ``unbucketed``)."""
    buckets = [make_bucket(dag, [m], close_reason=reason if len(b) > 1 else b.close_reason, label=b.label)
               for b in like.buckets for m in b.members]
    buckets.sort(key=lambda b: b.members[0])
    return BucketPlanResult(buckets=buckets, unbucketed=dict(like.unbucketed),
                            n_collectives_before=like.n_collectives_before,
                            unmatched_entries=list(like.unmatched_entries))
