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
"""

from __future__ import annotations

from typing import Sequence

from ..dag.graph import Dag, NodeKind
from .memory import wait_collectives


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
