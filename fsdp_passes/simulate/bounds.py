"""A lower bound on the makespan of any valid order of a DAG.

Two facts hold in every schedule the simulator accepts:

- the compute stream runs every non-collective node one after another, so the makespan is at least their
  total duration;
- a process group runs its collectives one after another in a fixed sequence c_0..c_m.  Collective c_j
  cannot be issued before every non-collective ancestor of c_0..c_j has run (issue times grow along the
  order, and the group keeps its sequence), and no non-collective descendant of a wait of c_k..c_m can
  start before c_k has finished.  So for every j <= k:

      makespan >= head_j + comm(c_j..c_k) + tail_k

  head_0 + comm(all) + tail_m is the classic "compute before the first collective, all communication,
  compute after the last one"; taking the best j, k costs nothing extra and is never weaker.

head_j and tail_k are grown incrementally (each node is visited once per group and direction), so the
whole bound is O(G * (V + E)) for G process groups.  Bitset reachability is avoided on purpose: memoised
ancestor masks of a long chain are quadratic in memory.

``overlap_lower_bound`` adds what overlapping must cost under ``OverlapCosts``: compute that runs while a
collective is in flight progresses ``1 + s`` times slower (s = ``compute_slowdown``).  Split any schedule at
collective c_j's start and c_k's end (j <= k, one group) into three regions: before (c_0..c_{j-1} run there
and at least head_j of compute), between (c_j..c_k) and after (c_{k+1}..c_m and at least tail_k).  A region
whose group stream is busy for C ms and whose compute stream runs w ms of work lasts at least
C + max(0, w - C / (1 + s)): while the stream is busy, compute gets at most C / (1 + s) done.  Placing the
remaining W - head_j - tail_k of work where it costs least gives, with cap = C / (1 + s) per region,

    makespan >= C_all + (head_j - cap_before)+ + (tail_k - cap_after)+
                + (W - max(head_j, cap_before) - max(tail_k, cap_after) - cap_between)+

With s = 0 this is never below the first bound's head_j + comm(c_j..c_k) + tail_k; with s > 0 it prices the
exposed first gather (j = k = 0: nothing but head_0 can run before it, little beside it) and the slowdown
every other hidden collective costs at once.  The host issue time of the collectives, I, runs on the
compute stream unslowed: a busy ms of a group stream absorbs 1 ms of it but only 1 / (1 + s) ms of
compute, so it enters W as I / (1 + s) ms of compute (never more than it costs; c_0..c_j's share in
head_j, since they are issued before c_j starts); and a separate term,
W + I + (C_g - I)+ * s / (1 + s), counts it in full where all of it can run beside collectives.
"""

from __future__ import annotations

from typing import Sequence

from ..dag.graph import Dag, NodeKind
from .memory import wait_collectives
from .overlap_costs import OverlapCosts


def lower_bound(dag: Dag, durations: Sequence[float]) -> float:
    """Makespan no valid order of ``dag`` can beat under ``durations`` (ms per node id)."""
    nodes = dag.nodes
    n = len(nodes)
    if len(durations) != n:
        raise ValueError(f"{len(durations)} durations for {n} nodes")
    dur = [float(d) for d in durations]
    collective = NodeKind.COLLECTIVE
    is_coll = [node.kind is collective for node in nodes]
    compute_total = sum(d for d, c in zip(dur, is_coll) if not c)

    waits: list[list[int]] = [[] for _ in range(n)]
    for w, c in enumerate(wait_collectives(dag)):
        if c >= 0:
            waits[c].append(w)

    best = compute_total
    for seq in dag.group_sequences().values():
        heads = _grow(seq, dag.preds, lambda c: dag.preds[c], dur, is_coll)
        tails_rev = _grow(seq[::-1], dag.succs, waits.__getitem__, dur, is_coll)
        tails = tails_rev[::-1]
        # max over j <= k of heads[j] - prefix[j] + prefix[k + 1] + tails[k], in one sweep over k
        prefix = 0.0
        best_head = float("-inf")
        for k, c in enumerate(seq):
            best_head = max(best_head, heads[k] - prefix)
            prefix += dur[c]
            best = max(best, best_head + prefix + tails[k])
    return best


def overlap_lower_bound(dag: Dag, durations: Sequence[float], overlap: OverlapCosts | None = None) -> float:
    """Makespan no valid order of ``dag`` can beat under ``durations`` (ms per node id) when overlapping costs
    ``overlap`` (see the module docstring); equal to ``lower_bound`` or above it.  O(sum over groups of the
    square of their collective count) on top of ``lower_bound``."""
    best = lower_bound(dag, durations)
    slowdown = overlap.compute_slowdown if overlap is not None else 0.0
    issue_ms = overlap.issue_ms if overlap is not None else 0.0
    nodes = dag.nodes
    dur = [float(d) for d in durations]
    collective = NodeKind.COLLECTIVE
    is_coll = [node.kind is collective for node in nodes]
    work = sum(d for d, c in zip(dur, is_coll) if not c)
    issue_total = issue_ms * sum(is_coll)
    sequences = dag.group_sequences()
    if slowdown <= 0.0 and issue_total <= 0.0:
        return best
    share = slowdown / (1.0 + slowdown)  # of each busy ms of a group stream that overlapped compute loses
    waits: list[list[int]] = [[] for _ in range(len(nodes))]
    for w, c in enumerate(wait_collectives(dag)):
        if c >= 0:
            waits[c].append(w)
    for seq in sequences.values():
        comm = [dur[c] for c in seq]
        comm_all = sum(comm)
        best = max(best, work + issue_total + max(0.0, comm_all - issue_total) * share)
        if slowdown <= 0.0:
            continue
        heads = _grow(seq, dag.preds, lambda c: dag.preds[c], dur, is_coll)
        tails = _grow(seq[::-1], dag.succs, waits.__getitem__, dur, is_coll)[::-1]
        prefix = [0.0]
        for d in comm:
            prefix.append(prefix[-1] + d)
        rate = 1.0 + slowdown
        # the issue time as compute it could stand in for (see the module docstring)
        work_and_issue = work + issue_total / rate
        issue_each = issue_ms / rate
        for j, head in enumerate(heads):
            head += (j + 1) * issue_each  # c_0..c_j are issued before c_j starts
            cap_before = prefix[j] / rate
            head_excess = max(0.0, head - cap_before)
            head_used = max(head, cap_before)
            for k in range(j, len(seq)):
                cap_after = (comm_all - prefix[k + 1]) / rate
                tail = tails[k]
                cap_between = (prefix[k + 1] - prefix[j]) / rate
                rest = work_and_issue - head_used - max(tail, cap_after) - cap_between
                bound = comm_all + head_excess + max(0.0, tail - cap_after) + max(0.0, rest)
                if bound > best:
                    best = bound
    return best


def _grow(
    seq: Sequence[int],
    adjacency: list[list[int]],
    seeds_of,
    dur: list[float],
    is_coll: list[bool],
) -> list[float]:
    """Running total duration of the non-collective nodes reachable (via ``adjacency``) from the seeds of
    seq[0], seq[0..1], ...; seeds themselves count.  Each node is visited at most once overall."""
    seen = bytearray(len(dur))
    total = 0.0
    out: list[float] = []
    for c in seq:
        stack = []
        for s in seeds_of(c):
            if not seen[s]:
                seen[s] = 1
                stack.append(s)
        while stack:
            u = stack.pop()
            if not is_coll[u]:
                total += dur[u]
            for v in adjacency[u]:
                if not seen[v]:
                    seen[v] = 1
                    stack.append(v)
        out.append(total)
    return out
