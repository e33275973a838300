"""Live-memory curve of an order: which buffers exist while each node runs.

A buffer belongs to the node that allocates it (``alias_of is None``); views and waits alias it.  A buffer is
freed right after the last node that uses it has run, where the users are the successors of the buffer's
node and of every node aliasing it.  Two rules extend a buffer's life:

- a collective's inputs stay alive until its wait has run, because NCCL reads them asynchronously after
  issue (until the end of the graph if nothing waits on it);
- a graph output (``is_output`` on the node or on any alias of it) stays alive to the end.

Graph inputs are not part of the DAG and so are not counted; a node kept for an input (``op ==
"placeholder"``) allocates nothing.
"""

from __future__ import annotations

from typing import Sequence

from ..dag.graph import Dag, NodeKind, buffer_roots

_INPUT_OPS = frozenset({"placeholder"})


def wait_collectives(dag: Dag) -> list[int]:
    """For every node, the collective it waits on, or -1 (not a wait, or a wait with no collective)."""
    nodes = dag.nodes
    out = [-1] * len(nodes)
    for i, node in enumerate(nodes):
        if node.kind is not NodeKind.WAIT:
            continue
        c = node.collective_of
        if c is None:
            # fall back to the data edge when the builder did not record the link
            c = next((p for p in dag.preds[i] if nodes[p].kind is NodeKind.COLLECTIVE), None)
        if c is not None:
            if not (0 <= c < len(nodes) and nodes[c].kind is NodeKind.COLLECTIVE):
                raise ValueError(f"wait {node.name} names node {c}, which is not a collective")
            out[i] = c
    return out


def _positions(dag: Dag, order: Sequence[int]) -> list[int]:
    n = len(dag.nodes)
    if len(order) != n:
        raise ValueError(f"order has {len(order)} entries for {n} nodes")
    pos = [-1] * n
    for p, i in enumerate(order):
        pos[i] = p
    return pos


def memory_curve(dag: Dag, order: Sequence[int]) -> list[int]:
    """Bytes live while each position of ``order`` runs: after its node allocated, before frees it causes.

    Counting a node's output together with its still-live inputs is what makes the peak meaningful: both
    exist while the node runs.  O(V + E); ``order`` must be a permutation (its validity is not checked).
    """
    nodes = dag.nodes
    n = len(nodes)
    pos = _positions(dag, order)
    root = buffer_roots(dag)

    # last position at which each buffer (indexed by its owner) is needed; an owner needs its own buffer
    last = list(pos)
    for u in range(n):
        r = root[u]
        lu = last[r]
        pu = pos[u]
        if pu > lu:
            lu = pu
        for v in dag.succs[u]:
            pv = pos[v]
            if pv > lu:
                lu = pv
        last[r] = lu

    # hold the inputs of every collective until its (last) wait; forever if it is never waited on
    hold = [-1] * n
    for w, c in enumerate(wait_collectives(dag)):
        if c >= 0 and pos[w] > hold[c]:
            hold[c] = pos[w]
    end = n - 1
    for c, node in enumerate(nodes):
        if node.kind is not NodeKind.COLLECTIVE:
            continue
        h = hold[c] if hold[c] >= 0 else end
        for p in dag.preds[c]:
            r = root[p]
            if h > last[r]:
                last[r] = h

    for i, node in enumerate(nodes):
        if node.is_output:
            last[root[i]] = end

    alloc = [0] * n  # by position
    freed = [0] * n  # by position
    for i, node in enumerate(nodes):
        if node.alias_of is None and node.op not in _INPUT_OPS and node.out_bytes:
            alloc[pos[i]] = node.out_bytes
            freed[last[i]] += node.out_bytes

    curve = [0] * n
    live = 0
    for p in range(n):
        live += alloc[p]
        curve[p] = live
        live -= freed[p]
    return curve


def peak_memory(dag: Dag, order: Sequence[int]) -> int:
    """Largest value of ``memory_curve`` (0 for an empty DAG)."""
    return max(memory_curve(dag, order), default=0)
