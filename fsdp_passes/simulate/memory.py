"""Live-memory curve of an order: which buffers exist while each node runs.

A buffer belongs to the node that allocates it (``alias_of is None``); views and waits alias it.  A buffer is
freed right after the last node that uses it has run, where the users are the successors of the buffer's
node and of every node aliasing it.  Two rules extend a buffer's life:

- a collective's inputs stay alive until its wait has run, because NCCL reads them asynchronously after
  issue (until the end of the graph if nothing waits on it);
- a graph output (``is_output`` on the node or on any alias of it) stays alive to the end.

Graph inputs are not part of the DAG and so are not counted; a node kept for an input (``op ==
"placeholder"``) allocates nothing.

``MemoryModel`` / ``MemoryTracker`` are the one implementation of these rules: ``memory_curve`` replays a whole
order with them, the reordering policy advances them node by node while it builds an order.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

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


class MemoryModel:
    """Static memory facts of a DAG under the rules above: the bytes each node allocates (``alloc``) and which
    node uses which buffer (``user_pairs``; a buffer is named by the id of the node that allocates it).
    ``curve`` evaluates a whole order; ``MemoryTracker`` advances one node at a time with ``uses`` / ``users``."""

    def __init__(self, dag: Dag, waited: Sequence[int] | None = None):
        """``waited``: ``wait_collectives(dag)``, when the caller has it already."""
        nodes = dag.nodes
        n = len(nodes)
        root = buffer_roots(dag)
        if waited is None:
            waited = wait_collectives(dag)
        alloc = [0] * n
        pinned = bytearray(n)  # alive to the end: never freed
        collectives: list[int] = []
        for i, node in enumerate(nodes):
            if node.alias_of is None and node.out_bytes and node.op not in _INPUT_OPS:
                alloc[i] = int(node.out_bytes)
            if node.is_output:
                pinned[root[i]] = 1
            if node.kind is NodeKind.COLLECTIVE:
                collectives.append(i)
        waits_of: dict[int, list[int]] = {}
        for w, c in enumerate(waited):
            if c >= 0:
                waits_of.setdefault(c, []).append(w)
        for c in collectives:
            if c not in waits_of:
                for p in dag.preds[c]:
                    pinned[root[p]] = 1
        self.n = n
        self.root = root
        self.alloc = alloc
        self._freeable = [bool(alloc[r]) and not pinned[r] for r in range(n)]
        self._waits_of = waits_of
        self._preds = dag.preds
        self._succs = dag.succs
        self._uses: list[list[int]] | None = None
        self._users: list[int] | None = None

    def user_pairs(self) -> Iterator[tuple[int, int]]:
        """``(node, buffer)`` for every use of a buffer that can be freed: the node owning it, every node
        aliasing it and the successors of all of those; and the waits of a collective reading it."""
        root, freeable, succs, preds = self.root, self._freeable, self._succs, self._preds
        for u in range(self.n):
            r = root[u]
            if freeable[r]:
                yield u, r
                for v in succs[u]:
                    yield v, r
        for c, ws in self._waits_of.items():
            for p in preds[c]:
                r = root[p]
                if freeable[r]:
                    for w in ws:
                        yield w, r

    def index_uses(self) -> None:
        """Build ``uses`` / ``users`` now (once; ``MemoryTracker`` needs them, and ``curve`` is faster with them)."""
        if self._uses is not None:
            return
        # the pairs of ``user_pairs``, in its order, without a generator step per pair
        root, freeable, succs, preds = self.root, self._freeable, self._succs, self._preds
        uses: list[list[int]] = [[] for _ in range(self.n)]
        for u in range(self.n):
            r = root[u]
            if freeable[r]:
                uses[u].append(r)
                for v in succs[u]:
                    uses[v].append(r)
        for c, ws in self._waits_of.items():
            for p in preds[c]:
                r = root[p]
                if freeable[r]:
                    for w in ws:
                        uses[w].append(r)
        users = [0] * self.n
        for u, lst in enumerate(uses):
            if len(lst) > 1:
                lst = uses[u] = sorted(set(lst))  # a node counts once per buffer it uses
            for r in lst:
                users[r] += 1
        self._uses, self._users = uses, users

    @property
    def uses(self) -> list[list[int]]:
        """Per node, the buffers it uses (ascending)."""
        if self._uses is None:
            self.index_uses()
        return self._uses  # type: ignore[return-value]

    @property
    def users(self) -> list[int]:
        """Per buffer, how many nodes use it."""
        if self._users is None:
            self.index_uses()
        return self._users  # type: ignore[return-value]

    def curve(self, order: Sequence[int]) -> list[int]:
        """Live bytes while each position of ``order`` runs: what ``MemoryTracker.run`` returns node by node,
        computed for a whole order at once (a buffer is freed at the position of its last user)."""
        n = self.n
        pos = [0] * n
        for p, i in enumerate(order):
            pos[i] = p
        last = [-1] * n
        if self._uses is not None:
            # the index holds every pair of ``user_pairs`` (once): the same last uses, found faster
            for u, rs in enumerate(self._uses):
                if rs:
                    pu = pos[u]
                    for r in rs:
                        if pu > last[r]:
                            last[r] = pu
        else:
            for u, r in self.user_pairs():
                pu = pos[u]
                if pu > last[r]:
                    last[r] = pu
        alloc = self.alloc
        allocated = [0] * n  # by position
        freed = [0] * n  # by position
        for i in range(n):
            a = alloc[i]
            if a:
                allocated[pos[i]] = a
                if last[i] >= 0:  # else never freed (an output, or an input of a collective nobody waits on)
                    freed[last[i]] += a
        curve = [0] * n
        live = 0
        for p in range(n):
            live += allocated[p]
            curve[p] = live
            live -= freed[p]
        return curve

    def freed_by(self, order: Iterable[int]) -> list[int]:
        """Bytes freed right after each node id runs, when run in ``order``."""
        tracker = MemoryTracker(self)
        out = [0] * self.n
        for i in order:
            before = tracker.live + self.alloc[i]
            tracker.run(i)
            out[i] = before - tracker.live
        return out


class MemoryTracker:
    """Live bytes of a growing order, updated per node in O(number of buffers the node uses)."""

    __slots__ = ("alloc", "uses", "remaining", "live", "peak")

    def __init__(self, model: MemoryModel):
        self.alloc = model.alloc
        self.uses = model.uses
        self.remaining = list(model.users)
        self.live = 0
        self.peak = 0

    def run(self, i: int) -> int:
        """Account node ``i`` running now; returns the live bytes while it runs."""
        live = self.live + self.alloc[i]
        during = live
        remaining = self.remaining
        alloc = self.alloc
        for r in self.uses[i]:
            k = remaining[r] - 1
            remaining[r] = k
            if k == 0:
                live -= alloc[r]
        self.live = live
        if during > self.peak:
            self.peak = during
        return during

    def frees_if_run(self, i: int) -> int:
        """Bytes that running ``i`` now would free (buffers whose only remaining user is ``i``)."""
        remaining = self.remaining
        alloc = self.alloc
        total = 0
        for r in self.uses[i]:
            if remaining[r] == 1:
                total += alloc[r]
        return total


def memory_curve(dag: Dag, order: Sequence[int], waited: Sequence[int] | None = None) -> list[int]:
    """Bytes live while each position of ``order`` runs: after its node allocated, before frees it causes.

    Counting a node's output together with its still-live inputs is what makes the peak meaningful: both
    exist while the node runs.  O(V + E); ``order`` must be a permutation (its validity is not checked).
    """
    if len(order) != len(dag.nodes):
        raise ValueError(f"order has {len(order)} entries for {len(dag.nodes)} nodes")
    return MemoryModel(dag, waited).curve(order)


def peak_memory(dag: Dag, order: Sequence[int]) -> int:
    """Largest value of ``memory_curve`` (0 for an empty DAG)."""
    return max(memory_curve(dag, order), default=0)
