"""Which collectives the backward issues, fixed before AOT autograd's partitioner decides by sizes.

The min-cut partitioner chooses, for each forward value the backward needs, whether to save it or recompute
it, and part of that choice weighs tensor sizes: a recomputable op whose output is at least 4× smaller than
its inputs is banned from recomputation ("reduction op"), the cut compares the bytes of what it would save.
A collective tagged for recomputation (selective activation checkpointing: FSDP's "reshard after forward"
gathers, any frontend's) is re-issued in backward whenever something recomputed there needs its output.  When
that need comes only from an *untagged* consumer, e.g. the embedding lookup ``weight[ids]`` on a gathered
table, the lookup is saved at a small local batch and recomputed (with a new all-gather of the table) at a
large one: ranks with different local shapes compile different collective sequences and hang.

``pin_recompute_decisions`` removes that freedom on the joint graph, before partitioning:

- an untagged forward collective is marked ``MUST_SAVE`` (torch does this too unless
  ``unsafe_allow_optimization_of_collectives``; here it holds whatever that flag says);
- for a collective tagged ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE``, its *recompute closure* is the collective
  and every forward node reached from it through nodes the partitioner always recomputes when needed
  (recompute-tagged nodes, views, ``getitem``).  If a backward node reads the closure, the backward issues
  the collective whatever the partitioner decides (nothing to pin).  Otherwise each untagged, non-view
  forward consumer of the closure is marked ``MUST_SAVE``: it is never recomputed, so nothing recomputed in
  backward needs the collective, which the backward then never issues.

Either way the collectives of the backward follow from the graph's structure and the checkpoint tags only.
``MUST_SAVE`` keeps what eager autograd keeps (outside a checkpointed region eager never recomputes), and the
partitioner honours it under an activation memory budget too (such nodes never enter its knapsack).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch.fx as fx
from torch._functorch.partitioners import get_default_op_list
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["RecomputePins", "pin_recompute_decisions"]

_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
_COLLECTIVE_NAMESPACE = "_c10d_functional"


@dataclass
class RecomputePins:
    """What ``pin_recompute_decisions`` did to one joint graph (node names)."""

    saved_collectives: list[str] = field(default_factory=list)  #: untagged collectives marked MUST_SAVE
    #: recompute-tagged collectives the backward reads through their closure (issued in backward regardless)
    needed_in_backward: list[str] = field(default_factory=list)
    #: recompute-tagged collectives whose untagged consumers were pinned (never issued in backward)
    pinned_collectives: list[str] = field(default_factory=list)
    pinned_consumers: list[str] = field(default_factory=list)  #: those consumers, marked MUST_SAVE


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == _COLLECTIVE_NAMESPACE


def _recompute_tagged(node: fx.Node) -> bool:
    return node.meta.get("recompute") in _RECOMPUTED


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a tangent (the joint graph's backward inputs), in one pass over the graph's
    topological order."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if str(node.target).startswith("tangents"):
                backward.add(node)
        elif node.op != "output" and any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    return backward


def pin_recompute_decisions(graph: fx.Graph) -> RecomputePins:
    """Mark nodes of the joint forward/backward ``graph`` ``MUST_SAVE`` (``node.meta["recompute"]``) so that
    the partitioner's choices cannot add or drop a collective in the backward (see the module docstring).
    A graph without tangents (inference) is left alone."""
    pins = RecomputePins()
    backward = _backward_nodes(graph)
    if not backward:
        return pins
    is_view = get_default_op_list().is_view

    def always_recomputed(node: fx.Node) -> bool:
        # what the partitioner recomputes whenever something needs it: tagged nodes, and views and getitems
        # (it never bans those, and recomputing them costs no saved bytes)
        return _recompute_tagged(node) or node.target is operator.getitem or is_view(node)

    for node in graph.nodes:
        if node in backward or not _is_collective(node):
            continue
        if not _recompute_tagged(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            pins.saved_collectives.append(node.name)
            continue
        closure, frontier, read_by_backward = {node}, [], False
        stack = [node]
        while stack:
            for user in stack.pop().users:
                if user in closure or user.op == "output":
                    continue
                if user in backward:
                    read_by_backward = True
                elif always_recomputed(user):
                    closure.add(user)
                    stack.append(user)
                elif user.op == "call_function" and user not in frontier:
                    frontier.append(user)
        if read_by_backward:
            pins.needed_in_backward.append(node.name)
            continue
        pins.pinned_collectives.append(node.name)
        for consumer in frontier:
            if consumer.meta.get("recompute") != CheckpointPolicy.MUST_SAVE:
                consumer.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                pins.pinned_consumers.append(consumer.name)
    return pins
