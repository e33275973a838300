"""Live-memory curve of an order: which buffers exist while each node runs.

A buffer belongs to the node that allocates it (``alias_of is None``); views and waits alias it.  A buffer is
freed right after the last node that uses it has run, where the users are the successors of the buffer's
node and of every node aliasing it.  A node writing several buffers (``DagNode.output_buffers``: a fused
kernel's outputs) allocates each of them, and each is freed after its own last reader; one that no memory
holds (read only inside its kernel, laid out inside another buffer) is not counted.  Two rules extend a
buffer's life:

- a collective's inputs stay alive until its wait has run, because NCCL reads them asynchronously after
  issue (until the end of the graph if nothing waits on it);
- a graph output (``is_output`` on the node or on any alias of it, ``graph_output`` on one of several
  buffers) stays alive to the end.

Graph inputs are not part of the DAG and so are not counted; a node kept for an input (``op ==
"placeholder"``) allocates nothing.

``MemoryModel`` / ``MemoryTracker`` are the one implementation of these rules: ``memory_curve`` replays a whole
order with them, the reordering policy advances them node by node while it builds an order.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate, chain, repeat
from operator import sub
from typing import Iterable, Iterator, Sequence

from ..dag.graph import Dag, NodeKind, buffer_readers, buffer_roots

_INPUT_OPS = frozenset({"placeholder"})


def wait_collectives(dag: Dag) -> list[int]:
    """For every node, the collective it waits on, or -1 (not a wait, or a wait with no collective)."""
    nodes = dag.nodes
    out = [-1] * len(nodes)
    wait = NodeKind.WAIT  # a local: reading an enum member off its class costs several times more
    for i, node in enumerate(nodes):
        if node.kind is not wait:
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
    """Static memory facts of a DAG under the rules above: the bytes each node allocates (``alloc``, by node
    id), the buffers (``buffer_bytes``, by buffer id) and which node uses which buffer (``uses`` / ``users``).
    Buffer ``i < n`` is the one buffer of node ``i``; a node writing several buffers (``DagNode.output_buffers``)
    owns buffers numbered from ``n`` instead, each freed after its own last reader.  ``curve`` evaluates a
    whole order; ``MemoryTracker`` advances one node at a time."""

    def __init__(self, dag: Dag, waited: Sequence[int] | None = None):
        """``waited``: ``wait_collectives(dag)``, when the caller has it already."""
        nodes = dag.nodes
        n = len(nodes)
        root = buffer_roots(dag)
        if waited is None:
            waited = wait_collectives(dag)
        size = [0] * n  # by buffer id
        alloc = [0] * n  # by node id
        owner = list(range(n))  # by buffer id: the node allocating it
        # a node with several buffers: its allocated buffers' ids, and per reader the ones it reads
        parts: dict[int, list[int]] = {}
        read_by: dict[int, dict[int, list[int]]] = {}
        pinned_parts: list[int] = []
        # per node, its output buffers and their readers (None: no node writes several buffers, the usual case)
        readers_of = buffer_readers(dag) if any(node.output_buffers for node in nodes) else None
        if readers_of is None:  # one buffer per node: its size, in one comprehension
            size = [0 if node.alias_of is not None or node.op in _INPUT_OPS else int(node.out_bytes) for node in nodes]
            alloc = list(size)
        for i, node in enumerate(nodes if readers_of is not None else ()):
            if node.alias_of is not None or node.op in _INPUT_OPS:
                continue
            bufs = readers_of[i]  # type: ignore[index]
            if not bufs:
                size[i] = alloc[i] = int(node.out_bytes)
                continue
            ids = parts[i] = []
            per_reader: dict[int, list[int]] = {}
            read_by[i] = per_reader
            for buf, readers in bufs:
                if not (buf.allocated and buf.nbytes):
                    continue
                b = len(size)
                ids.append(b)
                size.append(int(buf.nbytes))
                owner.append(i)
                alloc[i] += int(buf.nbytes)
                if buf.graph_output:
                    pinned_parts.append(b)
                for v in readers:
                    per_reader.setdefault(v, []).append(b)
        nb = len(size)
        pinned = bytearray(nb)  # alive to the end: never freed
        for b in pinned_parts:
            pinned[b] = 1

        def buffers_of(r: int) -> list[int]:
            """What a node using node ``r``'s output as a whole (its own, through a view or wait) keeps alive."""
            return parts.get(r) or [r]

        for i in [i for i, node in enumerate(nodes) if node.is_output]:
            if not (root[i] == i and i in parts):  # a part says itself whether it is returned
                for b in buffers_of(root[i]):
                    pinned[b] = 1
        # per node, the buffers it uses: its own (or those of the node it aliases) and those it reads
        preds = dag.preds
        waits_of: dict[int, list[int]] = {}
        for w, c in enumerate(waited):
            if c >= 0:
                waits_of.setdefault(c, []).append(w)
        collective = NodeKind.COLLECTIVE
        if parts:
            uses: list[list[int]] = []
            for v in range(n):
                lst = list(buffers_of(root[v]))
                for p in preds[v]:
                    r = root[p]
                    if p == r and r in read_by:
                        lst.extend(read_by[r].get(v, ()))
                    else:
                        lst.extend(buffers_of(r))
                uses.append(lst)
            # a collective's inputs are used by its waits too (read asynchronously until the wait has run)
            for i, node in enumerate(nodes):
                if node.kind is not collective:
                    continue
                own = buffers_of(root[i])
                inputs = [b for b in uses[i] if b not in own]
                ws = waits_of.get(i)
                if ws is None:
                    for b in inputs:  # read asynchronously by a collective nobody waits on: never freed
                        pinned[b] = 1
                else:
                    for w in ws:
                        uses[w].extend(inputs)
            freeable = [bool(size[b]) and not pinned[b] for b in range(nb)]
            is_freeable = freeable.__getitem__
            # sorted and without repeats: a node counts once per buffer it uses
            uses = [sorted(set(filter(is_freeable, lst))) if len(lst) > 1 else lst if is_freeable(lst[0]) else []
                    for lst in uses]
        else:
            uses = self._single_buffer_uses(nodes, preds, root, waits_of, size, pinned)
        counts = Counter(chain.from_iterable(uses))
        users = list(map(counts.get, range(nb), repeat(0))) if counts else [0] * nb  # ``get``: no ``__missing__`` call
        self.n = n
        self.n_buffers = nb
        self.root = root
        self.alloc = alloc
        self.buffer_bytes = size
        self.owner = owner
        self.uses = uses
        self.users = users

    @staticmethod
    def _single_buffer_uses(nodes: Sequence, preds: list[list[int]], root: list[int], waits_of: dict[int, list[int]],
                            size: list[int], pinned: bytearray) -> list[list[int]]:
        """``uses`` when every node is one buffer (buffer ids are node ids), pinning the inputs of collectives
        nobody waits on: the same lists as the general case, built without a set and a sort for the nodes that
        read one input (most of them)."""
        collective = NodeKind.COLLECTIVE
        root_of = root.__getitem__
        wait_inputs: dict[int, list[int]] = {}  # per wait: its collective's inputs (read until the wait has run)
        for i, node in enumerate(nodes):
            if node.kind is not collective:
                continue
            own = root[i]
            inputs = [r for r in map(root_of, preds[i]) if r != own]
            ws = waits_of.get(i)
            if ws is None:
                for b in inputs:  # read asynchronously by a collective nobody waits on: never freed
                    pinned[b] = 1
            elif inputs:
                for w in ws:
                    wait_inputs.setdefault(w, []).extend(inputs)
        freeable = [bool(nbytes) and not pin for nbytes, pin in zip(size, pinned)]
        uses: list[list[int]] = []
        append = uses.append
        for v, ps in enumerate(preds):
            r = root[v]
            if len(ps) == 1:
                q = root[ps[0]]
                if freeable[r]:
                    append(([r, q] if r < q else [q, r]) if freeable[q] and q != r else [r])
                else:
                    append([q] if freeable[q] else [])
            elif not ps:
                append([r] if freeable[r] else [])
            else:
                append(sorted({b for b in (r, *map(root_of, ps)) if freeable[b]}))
        for w, inputs in wait_inputs.items():
            uses[w] = sorted({b for b in (*uses[w], *inputs) if freeable[b]})
        return uses

    def user_pairs(self) -> Iterator[tuple[int, int]]:
        """``(node, buffer)`` for every use of a buffer that can be freed."""
        for u, lst in enumerate(self.uses):
            for b in lst:
                yield u, b

    def index_uses(self) -> None:
        """Kept for callers that prepared the index explicitly: ``uses`` / ``users`` are built with the model."""

    def curve(self, order: Sequence[int]) -> list[int]:
        """Live bytes while each position of ``order`` runs: what ``MemoryTracker.run`` returns node by node,
        computed for a whole order at once (a buffer is freed at the position of its last user)."""
        uses = self.uses
        last = [-1] * self.n_buffers
        for p, u in enumerate(order):  # positions ascend: the last write is the last user's
            for r in uses[u]:
                last[r] = p
        allocated = list(map(self.alloc.__getitem__, order))  # by position: a node allocates all its buffers
        freed = [0] * self.n  # by position
        # a buffer no one uses (-1) is never freed (an output, or an input of a collective nobody waits on)
        for nbytes, p in zip(self.buffer_bytes, last):
            if p >= 0:
                freed[p] += nbytes
        # live at position p: all allocated up to p, less all freed before p (a running sum, at C speed)
        return list(accumulate(map(sub, allocated, chain((0,), freed))))

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

    __slots__ = ("alloc", "buffer_bytes", "uses", "remaining", "live", "peak")

    def __init__(self, model: MemoryModel):
        self.alloc = model.alloc
        self.buffer_bytes = model.buffer_bytes
        self.uses = model.uses
        self.remaining = list(model.users)
        self.live = 0
        self.peak = 0

    def run(self, i: int) -> int:
        """Account node ``i`` running now; returns the live bytes while it runs."""
        live = self.live + self.alloc[i]
        during = live
        remaining = self.remaining
        size = self.buffer_bytes
        for r in self.uses[i]:
            k = remaining[r] - 1
            remaining[r] = k
            if k == 0:
                live -= size[r]
        self.live = live
        if during > self.peak:
            self.peak = during
        return during

    def frees_if_run(self, i: int) -> int:
        """Bytes that running ``i`` now would free (buffers whose only remaining user is ``i``)."""
        remaining = self.remaining
        size = self.buffer_bytes
        total = 0
        for r in self.uses[i]:
            if remaining[r] == 1:
                total += size[r]
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
