"""The cost-model bucket planner (``bucketing="auto"``).

A pure function of the DAG, the per-node durations and the options: no timing, so every rank plans the same
buckets.  See docs/bucketing.md for the algorithm in prose; in short, for every sequence of bucketable
collectives sharing (op, process group, reduce op, dtype, group size), in graph order, grow one bucket at a
time and add the next collective while all of these hold:

1. it does not depend on a member's result (forward taint over the bucket's id window);
2. the merged payload stays within ``bucket_cap_mb``;
3. the memory the merge keeps alive longer stays within ``memory_budget_bytes``;
4. one merged collective is cheaper than two (``cost(a + b) < cost(a) + cost(b)``);
5. merging does not expose more communication than issuing the two separately, on a model with one serial
   compute stream (graph order) and one FIFO communication stream for the sequence, where each collective is
   issued as soon as its inputs are ready and must finish before its first consumer starts.

Linear: each sequence is scanned once, and each bucket's dependency window is scanned once
(O(K · (V + E)) for K sequences, a handful in practice).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ..dag.graph import CollectiveOp, Dag, NodeKind
from ..dag.ops import op_base_name
from .plan import Bucket, BucketPlanResult, bucket_key, bucketability, make_bucket

# Ops that only cast / re-view a tensor: they can run as soon as their inputs exist, so they do not delay the
# earliest issue time of a collective they feed.
_LIGHT = frozenset({
    "convert_element_type", "_to_copy", "view", "reshape", "_unsafe_view", "clone", "t", "permute", "alias",
    "contiguous", "expand", "squeeze", "unsqueeze", "slice", "flatten", "detach", "as_strided", "split",
    "split_with_sizes", "getitem", "cat",
})

_EPS_MS = 1e-9


class CollectiveCost(Protocol):
    def collective_ms(self, op: CollectiveOp, nbytes: int, group_size: int, group_ranks=None) -> float: ...


def plan_auto(
    dag: Dag,
    durations: Sequence[float],
    cost_model: CollectiveCost,
    *,
    bucket_cap_mb: float | None = None,
    memory_budget_bytes: int | None = None,
    bucket_non_fsdp: bool = False,
) -> BucketPlanResult:
    """Greedy buckets per (op, group, reduce op, dtype) sequence; see the module docstring.

    durations: milliseconds per DAG node (``CostModel.estimate(dag)``); only compute nodes' entries are used
        for the compute timeline.
    bucket_cap_mb: largest merged payload, MiB (None: no cap).
    memory_budget_bytes: most bytes one bucket may keep alive longer than the unbucketed graph (None: no limit).
    """
    n = len(dag.nodes)
    if len(durations) != n:
        raise ValueError(f"plan_auto: {len(durations)} durations for a DAG of {n} nodes")
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}: expected a positive number of MiB or None")
    if memory_budget_bytes is not None and memory_budget_bytes < 0:
        raise ValueError(f"memory_budget={memory_budget_bytes!r} bytes: expected >= 0")
    cap_bytes = None if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)

    ready, first_use = _timeline(dag, durations)

    collectives = dag.collectives()
    unbucketed: dict[int, str] = {}
    sequences: dict[tuple, list[int]] = {}
    for c in collectives:
        why = bucketability(dag, c, bucket_non_fsdp=bucket_non_fsdp)
        if why:
            unbucketed[c] = why
        else:
            sequences.setdefault(bucket_key(dag.nodes[c]), []).append(c)

    buckets: list[Bucket] = []
    for key, seq in sequences.items():
        buckets.extend(_plan_sequence(dag, seq, ready, first_use, cost_model, cap_bytes, memory_budget_bytes, key))
    buckets.sort(key=lambda b: b.members[0])
    return BucketPlanResult(buckets=buckets, unbucketed=unbucketed, n_collectives_before=len(collectives))


def _timeline(dag: Dag, durations: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per node: earliest time its inputs are ready, and start time of its wait's first consumer (collectives).

    Compute runs serially in graph order: node i starts at T[i], the sum of earlier compute durations.  A
    light node (cast / view) may run as soon as its inputs exist, so a collective fed by a cast of a graph
    input is ready at time ~0 even if the cast sits late in the graph.
    """
    nodes = dag.nodes
    n = len(nodes)
    start = [0.0] * n
    t = 0.0
    for i, node in enumerate(nodes):
        start[i] = t
        if node.kind is NodeKind.COMPUTE:
            t += max(0.0, float(durations[i]))
    end = t
    finish = [0.0] * n
    ready = [0.0] * n
    for i, node in enumerate(nodes):
        r = 0.0
        for p in dag.preds[i]:
            if finish[p] > r:
                r = finish[p]
        ready[i] = r
        own = max(0.0, float(durations[i])) if node.kind is NodeKind.COMPUTE else 0.0
        if node.kind is NodeKind.COMPUTE and op_base_name(node.op)[1] in _LIGHT:
            finish[i] = r + own
        else:
            finish[i] = max(start[i], r) + own
    first_use = [end] * n
    for c in range(n):
        if nodes[c].kind is not NodeKind.COLLECTIVE:
            continue
        best = end
        for w in dag.succs[c]:
            if nodes[w].kind is not NodeKind.WAIT:
                continue
            for s in dag.succs[w]:
                if start[s] < best:
                    best = start[s]
        first_use[c] = best
    return ready, first_use


class _Open:
    """The bucket being grown, with O(1) running totals."""

    def __init__(self, dag: Dag, c: int, ready: float, use: float) -> None:
        node = dag.nodes[c]
        self.members = [c]
        self.bytes = node.comm_bytes
        self.ready = ready
        self.use = use
        self.bytes_at_min_use = node.comm_bytes  # gathered bytes first needed at the bucket's first use
        self.max_ready = ready
        self.bytes_at_max_ready = node.comm_bytes  # inputs ready last (not held for others)
        self.tainted = {c}
        self.scanned = c

    def add(self, j: int, bj: int, rj: float, uj: float) -> None:
        """Take collective ``j`` (payload ``bj``, ready at ``rj``, first used at ``uj``) into the bucket."""
        self.members.append(j)
        self.bytes += bj
        self.ready = max(self.ready, rj)
        if uj < self.use:
            self.use, self.bytes_at_min_use = uj, bj
        elif uj == self.use:
            self.bytes_at_min_use += bj
        if rj > self.max_ready:
            self.max_ready, self.bytes_at_max_ready = rj, bj
        elif rj == self.max_ready:
            self.bytes_at_max_ready += bj

    def extra_bytes(self, op: CollectiveOp, group_size: int, add: tuple[int, float, float] | None = None) -> int:
        total, at_min, at_max = self.bytes, self.bytes_at_min_use, self.bytes_at_max_ready
        use, max_ready = self.use, self.max_ready
        if add is not None:
            b, r, u = add
            total += b
            if u < use:
                at_min = b
            elif u == use:
                at_min += b
            if r > max_ready:
                at_max = b
            elif r == max_ready:
                at_max += b
        if len(self.members) + (add is not None) < 2:
            return 0
        if op is CollectiveOp.ALL_GATHER:
            # gathered members needed later than the first one are alive from the merged wait on; the merged
            # output lives next to the members' copies while they are made; plus the copy-in
            return (total - at_min) + total + total // max(group_size, 1)
        # inputs ready early are held until the merged collective is issued; plus the concatenated copy-in
        return total - at_max + total


def _plan_sequence(dag: Dag, seq: list[int], ready: list[float], first_use: list[float], cm: CollectiveCost,
                   cap_bytes: int | None, budget: int | None, key: tuple) -> list[Bucket]:
    first = dag.nodes[seq[0]]
    op = first.collective
    # an all-reduce names only its group; when the group is not known to this process, price it as 2 ranks
    group_size = first.group_size or 2
    ranks = first.group_ranks
    label = f"auto:{key[0]}:{key[1]}:{key[3]}"
    cache: dict[int, float] = {}

    def cost(nbytes: int) -> float:
        v = cache.get(nbytes)
        if v is None:
            v = float(cm.collective_ms(op, nbytes, group_size, ranks))
            cache[nbytes] = v
        return v

    preds = dag.preds
    out: list[Bucket] = []
    stream_free = 0.0
    cur = _Open(dag, seq[0], ready[seq[0]], first_use[seq[0]])

    def close(reason: str) -> None:
        nonlocal stream_free
        b = make_bucket(dag, cur.members, close_reason=reason, label=label)
        b.extra_bytes = cur.extra_bytes(op, group_size)
        out.append(b)
        stream_free = max(stream_free, cur.ready) + cost(cur.bytes)

    for j in seq[1:]:
        bj = dag.nodes[j].comm_bytes
        rj, uj = ready[j], first_use[j]
        reason = None
        # 1. dependency: does j's input depend on a member? (taint the window up to j, once per bucket)
        tainted = cur.tainted
        for v in range(cur.scanned + 1, j):
            if any(p in tainted for p in preds[v]):
                tainted.add(v)
        cur.scanned = j
        if any(p in tainted for p in preds[j]):
            reason = "dependency"
        elif cap_bytes is not None and cur.bytes + bj > cap_bytes:
            reason = "size_cap"
        elif budget is not None and cur.extra_bytes(op, group_size, (bj, rj, uj)) > budget:
            reason = "memory"
        else:
            c_b, c_j, c_m = cost(cur.bytes), cost(bj), cost(cur.bytes + bj)
            if not c_m < c_b + c_j:
                reason = "latency"
            else:
                m_ready, m_use = max(cur.ready, rj), min(cur.use, uj)
                exposed_merged = max(0.0, max(stream_free, m_ready) + c_m - m_use)
                fin_b = max(stream_free, cur.ready) + c_b
                exposed_split = max(0.0, fin_b - cur.use) + max(0.0, max(fin_b, rj) + c_j - uj)
                if exposed_merged > exposed_split + _EPS_MS:
                    reason = "overlap"
        if reason is not None:
            close(reason)
            cur = _Open(dag, j, rj, uj)
            continue
        cur.add(j, bj, rj, uj)
        tainted.add(j)
    close("end")
    return out
