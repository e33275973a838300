"""Putting a kernel group back together after the scheduling pass split it.

Nodes that share ``DagNode.kernel_group`` were consecutive in the graph's order and are emitted as one
generated kernel while they stay next to each other.  A collective issued, or waited on, between two of them
splits that kernel into two new ones, and a layer whose kernel is split differently from its neighbours' no
longer reuses their code: the compile gains a kernel of its own to build.  The scheduling pass places
collectives (and compute it runs ahead) between compute nodes without knowing this;
``keep_kernel_groups_whole`` then moves what it put inside a group out to one side of it where the caller's
``fits`` accepts the result (``plan_order``: within the memory limit, exposing and taking no more simulated
time than the pass's own order: a whole kernel is worth no slower step).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..dag.graph import Dag, NodeKind

__all__ = ["keep_kernel_groups_whole"]


def keep_kernel_groups_whole(dag: Dag, order: Sequence[int],
                             fits: Callable[[list[int]], bool] | None = None) -> tuple[list[int], int]:
    """``order`` with kernel groups' members made contiguous where that keeps the order valid and ``fits``
    accepts it, and how many groups were put back together.

    Of the nodes placed inside a group, the ones downstream of a member go after it and the ones feeding a
    later member before it.  The rest go, in the first arrangement ``fits`` (called with the whole order)
    accepts: collectives and their inputs before the group, the others after it (a prefetch stays a
    prefetch); all after it; all before it.  Members keep their order, as do the nodes on each side, so
    dependencies hold; a group whose repair would reorder a process group's collectives, or that no
    arrangement fits, is left split.
    """
    groups: dict[int, list[int]] = {}
    for i, node in enumerate(dag.nodes):
        if node.kernel_group is not None:
            groups.setdefault(node.kernel_group, []).append(i)
    new_order = list(order)
    if not groups:
        return new_order, 0
    pos = [0] * len(new_order)
    for p, i in enumerate(new_order):
        pos[i] = p
    preds, succs = dag.preds, dag.succs
    regrouped = 0
    for members in groups.values():
        lo = min(pos[m] for m in members)
        hi = max(pos[m] for m in members)
        if hi - lo + 1 == len(members):
            continue
        segment = new_order[lo:hi + 1]
        member = set(members)
        downstream: set[int] = set()  # of a member placed before it
        for v in segment:
            if v not in member and any(p in member or p in downstream for p in preds[v] if lo <= pos[p] <= hi):
                downstream.add(v)
        feeds: set[int] = set()  # upstream of a member placed after it
        prefetch: set[int] = set()  # that, or a collective, or upstream of one
        for v in reversed(segment):
            if v in member or v in downstream:
                continue
            later = [s for s in succs[v] if lo <= pos[s] <= hi]
            if any(s in member or s in feeds for s in later):
                feeds.add(v)
            if v in feeds or dag.nodes[v].kind is NodeKind.COLLECTIVE or any(s in prefetch for s in later):
                prefetch.add(v)
        everything_else = {v for v in segment if v not in member and v not in downstream}
        tried: list[set[int]] = []
        for before in (prefetch, feeds, everything_else):
            if before in tried:
                continue
            tried.append(before)
            arranged = ([v for v in segment if v in before] + [v for v in segment if v in member]
                        + [v for v in segment if v not in member and v not in before])
            if not _keeps_group_order(dag, arranged):
                continue
            candidate = new_order[:lo] + arranged + new_order[hi + 1:]
            if fits is None or fits(candidate):
                new_order = candidate
                for p, v in enumerate(arranged, lo):
                    pos[v] = p
                regrouped += 1
                break
    return new_order, regrouped


def _keeps_group_order(dag: Dag, segment: list[int]) -> bool:
    """Whether the collectives in ``segment`` are in node-id order within each process group (the graph's
    issue order, which a valid order keeps)."""
    last: dict[str | None, int] = {}
    for v in segment:
        node = dag.nodes[v]
        if node.kind is NodeKind.COLLECTIVE:
            if last.get(node.group_name, -1) > v:
                return False
            last[node.group_name] = v
    return True
