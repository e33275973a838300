"""At most one collective in flight per process group: for gloo groups with several worker threads.

With two or more worker threads a gloo group runs collectives issued together at the same time, and
``benchmarks/gloo_view_race.py`` corrupted the heap that way now and then (docs/benchmarks.md, "Heap stress");
with one in flight at a time it never did.  ``one_in_flight`` moves the waits of such a group's collectives
forward so that each one is waited on before the group's next collective is issued.
"""

from __future__ import annotations

from typing import Collection, Sequence

from ..dag.graph import Dag, NodeKind

__all__ = ["max_in_flight", "one_in_flight"]


def max_in_flight(dag: Dag, order: Sequence[int]) -> dict[str, int]:
    """Per process group, the most of its collectives issued and not yet (fully) waited on at once in ``order``."""
    waits_left: dict[int, int] = {}
    in_flight: dict[str, int] = {}
    most: dict[str, int] = {}
    for i in order:
        node = dag.nodes[i]
        if node.kind is NodeKind.COLLECTIVE:
            group = node.group_name or "?"
            waits_left[i] = len(dag.waits_of(i))
            in_flight[group] = in_flight.get(group, 0) + 1
            most[group] = max(most.get(group, 0), in_flight[group])
            if waits_left[i] == 0:
                in_flight[group] -= 1
        elif node.kind is NodeKind.WAIT and node.collective_of is not None:
            c = node.collective_of
            waits_left[c] -= 1
            if waits_left[c] == 0:
                in_flight[dag.nodes[c].group_name or "?"] -= 1
    return most


def one_in_flight(dag: Dag, order: Sequence[int], groups: Collection[str]) -> tuple[list[int], int]:
    """``order`` with the waits of ``groups``' collectives moved forward, each to just before its group's next
    collective where it came later; returns the new order and how many waits moved.  A wait depends on its
    collective only, so the move keeps every dependency (and every group's sequence)."""
    groups = set(groups)
    position = {n: k for k, n in enumerate(order)}
    out: list[int] = []
    moved: set[int] = set()
    open_: dict[str, list[int]] = {}
    for i in order:
        if i in moved:
            continue
        node = dag.nodes[i]
        if node.kind is NodeKind.COLLECTIVE and (node.group_name or "?") in groups:
            group = node.group_name or "?"
            for c in open_.pop(group, []):
                for w in sorted(dag.waits_of(c), key=position.__getitem__):
                    if position[w] > position[i] and w not in moved:
                        if any(p != c and position[p] > position[i] for p in dag.preds[w]):
                            continue  # not a plain wait: leave it (order_violations would name it)
                        out.append(w)
                        moved.add(w)
            open_[group] = [i]
        out.append(i)
    return out, len(moved)
