"""Memory pressure: an exact incremental live-bytes tracker and a headroom tree over the original order.

``MemoryModel`` / ``MemoryTracker`` follow the simulator's rules (``fsdp_passes.simulate.memory``):

- a node allocates ``out_bytes`` when it runs unless it aliases another node's buffer (``alias_of``) or is a
  graph input (``op == "placeholder"``);
- a buffer is freed right after the last of its users has run: its owner, every node aliasing it, and the
  successors of all of those;
- a collective's inputs are also used by its waits (NCCL reads them until the wait); a collective nobody
  waits on, and any buffer that is (or is aliased by) a graph output, keeps them alive to the end.

The live bytes while node ``i`` runs are those after ``i`` allocated and before the frees it causes, so
running a whole order through ``MemoryTracker.run`` yields the same curve as ``simulate.memory_curve``.

``HeadroomTree`` is a segment tree over the positions of the original order holding that order's memory
curve plus every extra live range the scheduler has committed to (a gather issued before its original
position, a wait deferred past it, a compute node pulled ahead).  Range add and range max are O(log n).
"""

from __future__ import annotations

from typing import Iterable

from ..dag.graph import Dag, buffer_roots
from .structure import Structure

_INPUT_OPS = frozenset({"placeholder"})


class MemoryModel:
    """Static memory facts: bytes each node allocates and, per node, the buffers it is a user of."""

    def __init__(self, dag: Dag, s: Structure):
        nodes = dag.nodes
        n = s.n
        root = buffer_roots(dag)
        alloc = [0] * n
        for i, node in enumerate(nodes):
            if node.alias_of is None and node.op not in _INPUT_OPS and node.out_bytes:
                alloc[i] = int(node.out_bytes)
        pinned = bytearray(n)  # alive to the end: never freed
        for i, node in enumerate(nodes):
            if node.is_output:
                pinned[root[i]] = 1
        for c in s.collectives:
            if not s.waits_of[c]:
                for p in dag.preds[c]:
                    pinned[root[p]] = 1

        uses: list[list[int]] = [[] for _ in range(n)]
        for u in range(n):
            r = root[u]
            if alloc[r] and not pinned[r]:
                uses[u].append(r)
                for v in dag.succs[u]:
                    uses[v].append(r)
        for c in s.collectives:
            ws = s.waits_of[c]
            for p in dag.preds[c]:
                r = root[p]
                if alloc[r] and not pinned[r]:
                    for w in ws:
                        uses[w].append(r)
        users = [0] * n
        for u in range(n):
            lst = uses[u]
            if len(lst) > 1:
                lst = sorted(set(lst))
                uses[u] = lst
            for r in lst:
                users[r] += 1
        self.n = n
        self.root = root
        self.alloc = alloc
        self.uses = uses
        self.users = users

    def curve(self, order: Iterable[int]) -> list[int]:
        """Live bytes while each position of ``order`` runs."""
        tracker = MemoryTracker(self)
        return [tracker.run(i) for i in order]

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


class HeadroomTree:
    """Range add / range max over positions 0..n-1 (bottom-up segment tree, lazy adds kept per node)."""

    __slots__ = ("n", "h", "t", "d")

    def __init__(self, values: list[int]):
        n = max(1, len(values))
        self.n = n
        self.h = n.bit_length()
        t = [0] * (2 * n)
        t[n : n + len(values)] = values
        for i in range(n - 1, 0, -1):
            a, b = t[2 * i], t[2 * i + 1]
            t[i] = a if a > b else b
        self.t = t
        self.d = [0] * n

    def _apply(self, p: int, v: int) -> None:
        self.t[p] += v
        if p < self.n:
            self.d[p] += v

    def _build(self, p: int) -> None:
        t, d = self.t, self.d
        while p > 1:
            p >>= 1
            a, b = t[2 * p], t[2 * p + 1]
            t[p] = (a if a > b else b) + d[p]

    def _push(self, p: int) -> None:
        d = self.d
        for s in range(self.h, 0, -1):
            i = p >> s
            if i and d[i]:
                self._apply(2 * i, d[i])
                self._apply(2 * i + 1, d[i])
                d[i] = 0

    def add(self, lo: int, hi: int, v: int) -> None:
        """Add ``v`` to positions lo..hi-1."""
        if lo >= hi or not v:
            return
        n = self.n
        lo += n
        hi += n
        l0, r0 = lo, hi
        while lo < hi:
            if lo & 1:
                self._apply(lo, v)
                lo += 1
            if hi & 1:
                hi -= 1
                self._apply(hi, v)
            lo >>= 1
            hi >>= 1
        self._build(l0)
        self._build(r0 - 1)

    def max(self, lo: int, hi: int) -> int:
        """Largest value at positions lo..hi-1 (a very small number when the range is empty)."""
        if lo >= hi:
            return -(1 << 62)
        n = self.n
        lo += n
        hi += n
        self._push(lo)
        self._push(hi - 1)
        t = self.t
        res = -(1 << 62)
        while lo < hi:
            if lo & 1:
                if t[lo] > res:
                    res = t[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                if t[hi] > res:
                    res = t[hi]
            lo >>= 1
            hi >>= 1
        return res


__all__ = ["HeadroomTree", "MemoryModel", "MemoryTracker"]
