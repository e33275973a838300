"""Memory headroom over the original order, for the scheduler's gates.

``HeadroomTree`` is a segment tree over the positions of the original order holding that order's memory
curve (``fsdp_passes.simulate.memory``) plus every extra live range the scheduler has committed to (a gather
issued before its original position, a wait deferred past it, a compute node pulled ahead).  Range add and
range max are O(log n).
"""

from __future__ import annotations


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


__all__ = ["HeadroomTree"]
