"""Issue order inside a process group: let a backward re-gather go ahead of the reduction before it.

A backward graph with reshard-after-forward runs, per block ``i`` from the last: gather(i), compute(i),
reduce-scatter(i), gather(i-1), compute(i-1), ...  The reordering pass keeps each group's collective order
(every rank must issue the same sequence), so gather(i-1) can never be issued before reduce-scatter(i), whose
input exists only after compute(i): the gather cannot overlap compute(i) and is exposed in full.

This rewrite moves the run of reductions (reduce-scatters, all-reduces) that immediately precedes an FSDP
all-gather in its group, with the nodes between them that use the reductions' results, to just after that
all-gather.  The sequence becomes gather(i), gather(i-1), reduce-scatter(i), ...: in the rewritten graph
order nothing is issued earlier than before (the reductions are issued a little later, right after the
gather), but the reductions' inputs now live while the gather's output does, so a run moves only when its
payload fits in the memory budget left (``bucket_graph``); the reordering pass may then prefetch gather(i-1) under
compute(i) when its memory budget allows, and issues reduce-scatter(i) right behind it.  A gather too small
to stand for a block (under ``1 / SMALL_GATHER_RATIO`` of the next gather's payload: a final norm's weight
before the last block's) is passed too: the run, with the reductions right after that gather, goes behind
the next FSDP gather.

It is a pure function of the graph and the budget (payload bytes only), so every rank makes the same change; an all-gather never passes another
all-gather and reductions keep their order among themselves.  The ``collective_fingerprint`` in the dumps
records the resulting sequence.
"""

from __future__ import annotations

import torch.fx as fx

from ..dag.collectives import KINDS
from ..dag.graph import Dag

#: a run of reductions is moved only with at most this many nodes (the reductions, waits, casts, views)
MAX_MOVED = 64

#: a gather with less than 1/this of the next gather's payload is no block to hide a run of reductions behind (a
#: final norm's weight before the last block's): the run moves on past that next gather too
SMALL_GATHER_RATIO = 8


def _reduces(node) -> bool:
    return node.collective is not None and KINDS[node.collective].reduces


def _users_before(starts: list[fx.Node], stop: fx.Node, position: dict[fx.Node, int]) -> list[fx.Node] | None:
    """``starts`` and every node positioned before ``stop`` that (transitively) uses one of them, in graph
    order; None if ``stop`` is among them or they are too many."""
    limit = position[stop]
    found = set(starts)
    stack = list(starts)
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in found or position.get(user, limit) >= limit:
                if user is stop:
                    return None
                continue
            if user.op != "call_function" or len(found) >= MAX_MOVED:
                return None
            found.add(user)
            stack.append(user)
    return sorted(found, key=position.__getitem__)


def _fsdp_gather(node) -> bool:
    return node.collective is not None and KINDS[node.collective].gathers and node.fsdp


def issue_gathers_before_reductions(graph: fx.Graph, dag: Dag, *, max_moved_bytes: int | None = None,
                                    moved_bytes: list[int] | None = None) -> int:
    """Move each run of reductions that precedes an FSDP all-gather in its group to just after the gather.

    A gather carrying less than ``1 / SMALL_GATHER_RATIO`` of the next FSDP gather's payload does not count as
    a block: the run, with the reductions between the two, moves on past that next gather (and so on, while
    the gathers passed stay that small against the one after).  A final norm's 1 KiB gather between the output
    projection's 4 MiB reduction and the last block's re-gather would otherwise leave that re-gather queued
    behind the reduction.

    ``dag`` is ``dag_from_fx(graph)``; it is stale afterwards.  Returns how many runs moved ahead of a
    gather.

    Memory: a moved run's inputs stay alive while the gather's output exists, at most the run's payload
    (its reductions' ``comm_bytes``).  Only runs whose payload is within ``max_moved_bytes`` move (None: all);
    the payload of each moved run is appended to ``moved_bytes``.  Both are payloads, the same on every rank.
    """
    position = {node: i for i, node in enumerate(graph.nodes)}
    nodes_of = dag.nodes
    moved = 0
    for seq in dag.group_sequences().values():
        current = list(seq)  # the group's sequence as moved so far
        done: set[int] = set()  # reductions moved once already
        k = 1
        while k < len(current):
            if not _fsdp_gather(nodes_of[current[k]]):
                k += 1
                continue
            first = k
            while first > 0 and _reduces(nodes_of[current[first - 1]]) and current[first - 1] not in done:
                first -= 1
            if first == k:
                k += 1
                continue
            run = current[first:k]
            payload = sum(nodes_of[i].comm_bytes for i in run)
            if max_moved_bytes is not None and payload > max_moved_bytes:
                k += 1
                continue
            last = k  # the gather the run goes behind
            while True:
                nxt = last + 1
                while nxt < len(current) and _reduces(nodes_of[current[nxt]]):
                    nxt += 1
                if nxt == len(current) or not _fsdp_gather(nodes_of[current[nxt]]):
                    break
                if nodes_of[current[last]].comm_bytes * SMALL_GATHER_RATIO >= nodes_of[current[nxt]].comm_bytes:
                    break  # a block of its own
                more = run + current[last + 1:nxt]
                more_payload = sum(nodes_of[i].comm_bytes for i in more)
                if max_moved_bytes is not None and more_payload > max_moved_bytes:
                    break
                run, payload, last = more, more_payload, nxt
            target = nodes_of[current[last]].origin
            passed = {nodes_of[i].origin for i in current[k:last + 1] if i not in run}
            nodes = _users_before([nodes_of[i].origin for i in run], target, position)
            if nodes is None or passed.intersection(nodes):
                k += 1
                continue
            # the nodes from the first moved one to the gather keep their positions as a set: renumber that span
            low, high = position[nodes[0]], position[target]
            before_span = nodes[0].prev
            anchor: fx.Node = target
            for node in nodes:
                anchor.append(node)
                anchor = node
            moved += 1
            if moved_bytes is not None:
                moved_bytes.append(payload)
            node = before_span.next
            for pos in range(low, high + 1):
                position[node] = pos
                node = node.next
            kept = [i for i in current[first:last + 1] if i not in run]
            current[first:last + 1] = kept + run
            done.update(run)
            k = first + len(kept) + len(run)
    return moved


def renumbered(dag: Dag, graph: fx.Graph) -> Dag | None:
    """``dag`` (built from ``graph`` before some of its nodes moved) renumbered in ``graph``'s current order,
    or None when the move reversed one of its edges.

    When the new order is a linear extension of ``dag`` (every edge still points forward), this equals
    ``dag_from_fx(graph)``: the data edges are the same, and every buffer's readers and writers keep their
    relative order, so the mutation-order edges are the same too.  It only copies the nodes: no FX values
    are read again.
    """
    import copy

    id_of = {node.origin: i for i, node in enumerate(dag.nodes)}
    order = [id_of[n] for n in graph.nodes if n in id_of]
    if len(order) != len(dag.nodes):
        return None
    new_id = [0] * len(order)
    for pos, i in enumerate(order):
        new_id[i] = pos
    edges = []
    for u, vs in enumerate(dag.succs):
        nu = new_id[u]
        for v in vs:
            if new_id[v] < nu:
                return None
            edges.append((nu, new_id[v]))
    nodes = []
    for i in order:
        c = copy.copy(dag.nodes[i])
        if c.alias_of is not None:
            c.alias_of = new_id[c.alias_of]
        if c.collective_of is not None:
            c.collective_of = new_id[c.collective_of]
        nodes.append(c)
    return Dag(nodes, edges, dag.resident_bytes)


def restore_order(order: list[fx.Node]) -> None:
    """Put the nodes of a graph back in ``order`` (all of them, the output node last, as ``list(graph.nodes)``
    gave them before a move)."""
    output = order[-1]
    for node in order[:-1]:
        output.prepend(node)


__all__ = ["issue_gathers_before_reductions", "renumbered", "restore_order", "MAX_MOVED", "SMALL_GATHER_RATIO"]
