"""Static facts about a DAG that the scheduler reads many times: node classes, wait links, group sequences.

Everything here is computed once per ``plan_order`` call in O(V + E) and indexed by node id, so the
scheduling loop never walks dicts or sets of names.
"""

from __future__ import annotations

import operator
from itertools import accumulate, chain
from typing import Sequence

from ..dag.collectives import KINDS
from ..dag.graph import CollectiveOp, Dag, NodeKind
from ..simulate.memory import wait_collectives
from ..simulate.timeline import check_durations, group_key

#: scheduler classes of a node
COMPUTE, COLLECTIVE, WAIT = 0, 1, 2


def as_durations(dag: Dag, durations: Sequence[float]) -> list[float]:
    """The estimator input: one finite, non-negative duration (ms) per node id.

    A collective's duration is its time on its process group's stream; every other node's duration is its
    time on the compute stream (a wait's own duration comes after it stops blocking, normally 0).
    """
    return check_durations(dag, durations)


class Structure:
    """Per-node arrays derived from a ``Dag``.

    kind: COMPUTE, COLLECTIVE or WAIT (a wait that names no collective is scheduled like compute).
    coll_of: for a wait, its collective; else -1.  waits_of: for a collective, its waits (ascending).
    preds / succs: the DAG's edges plus the implicit collective -> wait edge when a builder left it out (the
    DAG's own lists where nothing is added: read only).
    group: stream key of a collective; seq: per group, its collectives in issue order; seq_pos: index of a
    collective in its group's sequence.  next_block_reduction: for an FSDP-like reduction, the group's first
    FSDP-like reduction after its next FSDP-like gather.
    fsdp / fence: FSDP-like collectives (may be prefetched) and those of a kind not ``movable``
    (``CollectiveOp.OTHER``: never moved, no collective is moved across them).
    computes / collectives / fences: ids of each class, ascending.
    region_start: for a compute node f, one past the previous compute node (the baseline positions that lie
    between two compute nodes belong to the later one's region).
    compute_before: for every node, how many compute nodes precede it in the original order.
    """

    def __init__(self, dag: Dag):
        nodes = dag.nodes
        n = len(nodes)
        self.n = n
        self.names = [node.name for node in nodes]
        kind = bytearray(n)
        collective = NodeKind.COLLECTIVE  # a local: reading an enum member off its class costs several times more
        collectives = [i for i, node in enumerate(nodes) if node.kind is collective]
        # one shared empty tuple for every node that is not a collective (read only, like the rest)
        waits_of: list = [()] * n
        for c in collectives:
            kind[c] = COLLECTIVE
            waits_of[c] = []
        # a wait on nothing we know (-1) is an ordinary node on the compute stream
        coll_of = wait_collectives(dag)
        # the DAG's own lists, read only; a list that gains the implicit edge is replaced by a sorted copy
        preds = list(dag.preds)
        succs = list(dag.succs)
        for w, c in enumerate(coll_of):  # one pass over the waits: their class, their lists, the implicit edge
            if c >= 0:
                kind[w] = WAIT
                waits_of[c].append(w)
                if c not in preds[w]:
                    if c > w:
                        raise ValueError(f"wait {nodes[w].name} comes before its collective {nodes[c].name}")
                    preds[w] = sorted([*preds[w], c])
                    succs[c] = sorted([*succs[c], w])
        self.kind = kind
        self.coll_of = coll_of
        self.preds = preds
        self.succs = succs
        self.waits_of: list[list[int]] = waits_of

        self.group: list[str] = [""] * n
        self.seq: dict[str, list[int]] = {}
        self.seq_pos = [-1] * n
        self.fsdp = bytearray(n)
        self.fence = bytearray(n)
        #: per collective: its CollectiveOp, and the lowest-numbered compute node that reads one of its waits
        #: (-1 when none does): where the original order starts consuming its output
        self.coll_op: list[CollectiveOp | None] = [None] * n
        self.first_use = [-1] * n
        for i in collectives:
            node = nodes[i]
            g = group_key(node.group_name)
            self.group[i] = g
            s = self.seq.setdefault(g, [])
            self.seq_pos[i] = len(s)
            s.append(i)
            if node.collective is not None and not KINDS[node.collective].movable:
                self.fence[i] = 1
            elif node.fsdp:
                self.fsdp[i] = 1
            self.coll_op[i] = node.collective
            use = -1
            for w in waits_of[i]:
                for v in succs[w]:
                    if kind[v] == COMPUTE and (use < 0 or v < use):
                        use = v
            self.first_use[i] = use

        #: per FSDP-like reduction: the group's first FSDP-like reduction after its next FSDP-like gather (the
        #: next block's; -1: none), in the group's sequence
        self.next_block_reduction = [-1] * n
        for s in self.seq.values():
            reduction = after_gather = -1  # scanning backwards: the latest reduction seen, and that of a block after
            for c in reversed(s):
                op = self.coll_op[c]
                if not self.fsdp[c] or op is None:
                    continue
                if KINDS[op].gathers:
                    after_gather = reduction
                elif KINDS[op].reduces:
                    self.next_block_reduction[c] = after_gather
                    reduction = c

        self.computes = [i for i in range(n) if kind[i] == COMPUTE]
        self.collectives = collectives
        self.fences = [i for i in self.collectives if self.fence[i]]
        #: collectives that keep their place relative to compute (no compute is pulled ahead of them)
        self.non_fsdp_collectives = [i for i in self.collectives if not self.fsdp[i]]

        region_start = [0] * n
        for f, prev in zip(self.computes, chain((-1,), self.computes)):
            region_start[f] = prev + 1
        self.region_start = region_start
        # a running count of the compute nodes (kind 0) before each position, at C speed
        self.compute_before = list(accumulate(map(operator.not_, kind[:-1]), initial=0)) if n else []

    def next_in_group(self, c: int) -> int:
        """The collective issued after ``c`` in its group, or -1."""
        s = self.seq[self.group[c]]
        k = self.seq_pos[c] + 1
        return s[k] if k < len(s) else -1
