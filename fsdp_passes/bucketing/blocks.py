"""Candidate plans for ``bucketing="auto"`` beside the greedy one: one bucket per module block, and no merging.

``fsdp_passes.pipeline.choice`` scores them against the greedy plan and picks one.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Mapping, Sequence

from ..dag.graph import Dag, NodeKind
from .manual import collective_fqn
from .plan import (Bucket, BucketKey, BucketLimit, BucketPlanResult, CollectiveSurvey, bucket_key, bucket_limit,
                   cut_to_bound, make_bucket, split_dependent, surveyed)

__all__ = ["REPEAT", "block_keys", "collective_blocks", "merged_block_buckets", "plan_per_block", "plan_unmerged",
           "repeated_blocks"]

#: the prefix of blocks found by the graph's repeated structure, not by module names
REPEAT = "<repeat>"

# how many of the most frequent gaps between equal signatures are tried as the period of a repeated block
_PERIODS_TRIED = 8


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


def _repeating_run(signatures: Sequence[Hashable]) -> tuple[int, int, int] | None:
    """The longest stretch of ``signatures`` made of one pattern repeated at least twice: (start, period,
    repetitions), or None.  Periods tried: the most frequent distances between equal signatures (a layer's
    first collective recurs once per layer), shortest first among equal coverage; O(n) per period."""
    last: dict[Hashable, int] = {}
    gaps: Counter[int] = Counter()
    for i, sig in enumerate(signatures):
        if sig in last:
            gaps[i - last[sig]] += 1
        last[sig] = i
    best: tuple[int, int, int] | None = None
    best_cover = 0
    for period in sorted(p for p, _ in gaps.most_common(_PERIODS_TRIED)):
        run = 0  # how many positions i so far have signatures[i] == signatures[i + period], consecutively
        for i in range(len(signatures) - period + 1):
            if i < len(signatures) - period and signatures[i] == signatures[i + period]:
                run += 1
                continue
            # the run of matches ending before i spans run + period positions: whole repetitions of it
            reps = (run + period) // period
            if reps >= 2 and reps * period > best_cover:
                best, best_cover = (i - run, period, reps), reps * period
            run = 0
    return best


def _compute_prefix(dag: Dag) -> list[int]:
    """``prefix[i]``: how many compute nodes come before node ``i``."""
    prefix = [0]
    count = 0
    compute = NodeKind.COMPUTE  # a local: reading an enum member off its class costs several times more
    for node in dag.nodes:
        if node.kind is compute:
            count += 1
        prefix.append(count)
    return prefix


def repeated_blocks(dag: Dag, members: Sequence[int], compute_prefix: Sequence[int] | None = None,
                    ) -> dict[int, str | None]:
    """Blocks found without module names: ``members`` (one bucketable sequence, in graph order) split where
    the graph repeats itself.  A collective's signature is its payload and the number of compute nodes
    between it and the next member; the longest stretch of one repeated pattern of signatures
    (``_repeating_run``) is cut into its repetitions, ``<repeat>.<j>`` each (no module can have that name);
    members outside it get None.
    Structure and payloads only, so the same on every rank."""
    if len(members) < 4:
        return {m: None for m in members}
    computes = compute_prefix if compute_prefix is not None else _compute_prefix(dag)
    ends = list(members[1:]) + [len(dag)]
    signatures = [(dag.nodes[m].comm_bytes, computes[e] - computes[m]) for m, e in zip(members, ends)]
    found = _repeating_run(signatures)
    out: dict[int, str | None] = {m: None for m in members}
    if found is not None:
        start, period, reps = found
        # the last repetition is followed by something else (the end of the layers), which changes the compute
        # counts around it: it is one more repetition if its payloads follow the pattern
        payloads = [sig[0] for sig in signatures]
        end = start + reps * period
        if payloads[end: end + period] == payloads[start: start + period]:
            reps += 1
        for j in range(reps):
            for m in members[start + j * period: start + (j + 1) * period]:
                out[m] = f"{REPEAT}.{j}"
    return out


def collective_blocks(dag: Dag, fqns: Mapping[int, str | None], keys: Mapping[int, BucketKey] | None = None,
                      ) -> dict[int, str | None]:
    """Bucketable collective id (with its FQN or None, in graph order) -> its block: by module names
    (``block_keys``), else, per bucketable sequence, by the graph's repeated structure (``repeated_blocks``).
    ``keys``: the collectives' ``bucket_key``s when the caller has them (``CollectiveSurvey.keys``)."""
    blocks = block_keys(fqns)
    unnamed: dict[BucketKey, list[int]] = {}
    for c in fqns:
        if blocks[c] is None:
            key = keys[c] if keys is not None else bucket_key(dag.nodes[c])
            unnamed.setdefault(key, []).append(c)
    if unnamed:
        prefix = _compute_prefix(dag)
        for members in unnamed.values():
            blocks.update(repeated_blocks(dag, members, prefix))
    return blocks


def plan_per_block(dag: Dag, *, bucket_non_fsdp: bool = False, param_fqns: Mapping[str, str] | None = None,
                   cap_bytes: int | None = None, extra_bytes_limit: BucketLimit = None,
                   survey: CollectiveSurvey | None = None) -> BucketPlanResult:
    """One bucket per module block (see ``block_keys``) per (op, group, reduce op, dtype, group size).

    Members that depend on each other are split into runs (``close_reason="dependency"``).  A run is cut
    where the next member would take it over ``cap_bytes`` (``"size_cap"``) or its ``extra_bytes_bound`` over
    ``extra_bytes_limit`` (``"memory"``), so both candidates obey the same per-bucket limits.  Collectives
    without an FQN are grouped by the graph's repeated structure (``repeated_blocks``); the rest stay alone.
    ``survey``: ``dag``'s collectives already judged with ``bucket_non_fsdp`` (``survey_collectives``).
    """
    survey = surveyed(dag, bucket_non_fsdp, survey)
    pieces = _block_pieces(dag, survey, param_fqns, cap_bytes, extra_bytes_limit)
    buckets = [make_bucket(dag, members, close_reason=why, label=label) for members, why, label in pieces]
    buckets.sort(key=lambda b: b.members[0])
    return BucketPlanResult(buckets=buckets, unbucketed=dict(survey.unbucketed),
                            n_collectives_before=len(survey.collectives))


def merged_block_buckets(dag: Dag, *, bucket_non_fsdp: bool = False, param_fqns: Mapping[str, str] | None = None,
                         survey: CollectiveSurvey | None = None) -> list[Bucket]:
    """The buckets of ``plan_per_block`` (no cap, no limit) that merge two or more collectives, in graph order,
    without building the single-collective ones (what the memory budget's block claim reads)."""
    pieces = _block_pieces(dag, surveyed(dag, bucket_non_fsdp, survey), param_fqns, None, None)
    buckets = [make_bucket(dag, members, close_reason=why, label=label) for members, why, label in pieces
               if len(members) > 1]
    buckets.sort(key=lambda b: b.members[0])
    return buckets


def _block_pieces(dag: Dag, survey: CollectiveSurvey, param_fqns: Mapping[str, str] | None, cap_bytes: int | None,
                  extra_bytes_limit: BucketLimit) -> list[tuple[list[int], str, str]]:
    """``plan_per_block``'s buckets as (members, close reason, label)."""
    keys = survey.keys
    nodes = dag.nodes
    fqns = {c: collective_fqn(nodes[c], param_fqns) for c in keys}
    blocks = collective_blocks(dag, fqns, keys)
    groups: dict[tuple[str, BucketKey], list[int]] = {}
    pieces: list[tuple[list[int], str, str]] = []
    for c, key in keys.items():  # graph order
        block = blocks[c]
        if block is None:
            pieces.append(([c], "plan", "block:?"))
        else:
            groups.setdefault((block, key), []).append(c)
    for (block, _), members in groups.items():
        label = f"block:{block}"
        runs = split_dependent(dag, members)
        for r_idx, run in enumerate(runs):
            for piece, why in cut_to_bound(dag, run, bucket_limit(extra_bytes_limit, dag.nodes[run[0]].collective),
                                           cap_bytes):
                if why is None:
                    why = "dependency" if r_idx < len(runs) - 1 else "plan"
                pieces.append((piece, why, label))
    return pieces


def plan_unmerged(dag: Dag, like: BucketPlanResult, reason: str = "score") -> BucketPlanResult:
    """``like``'s collectives, each alone (same ``unbucketed``)."""
    buckets = [make_bucket(dag, [m], close_reason=reason if len(b) > 1 else b.close_reason, label=b.label)
               for b in like.buckets for m in b.members]
    buckets.sort(key=lambda b: b.members[0])
    return BucketPlanResult(buckets=buckets, unbucketed=dict(like.unbucketed),
                            n_collectives_before=like.n_collectives_before,
                            unmatched_entries=list(like.unmatched_entries))
