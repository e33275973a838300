"""Memory headroom over the original order, for the scheduler's gates.

``HeadroomTree`` holds, per position of the original order, that order's memory curve
(``fsdp_passes.simulate.memory``) plus every extra live range the scheduler has committed to (a gather
issued before its original position, a wait deferred past it, a compute node pulled ahead), with range add
and range max.

Almost every range the scheduler charges is a few positions long and lies near the frontier, while a few
(pulling a node from far ahead) span most of the graph.  So the positions are cut into blocks: a range inside
one block is served from a flat list with slice operations (no per-level walk at all), and only the whole
blocks a long range covers go through a segment tree over the blocks' maxima (``RangeMaxTree``).  A block
whose values changed is written back to that tree lazily, once, before the next long range reads it, so
each operation costs O(block + log n) amortised, the block part at C speed.
"""

from __future__ import annotations

import operator
from itertools import repeat

#: positions per block of ``HeadroomTree``: ranges shorter than this never touch the segment tree
HEADROOM_BLOCK = 128

#: what ``max`` returns for an empty range
EMPTY_MAX = -(1 << 62)


class RangeMaxTree:
    """Range add / range max over positions 0..n-1: a bottom-up segment tree over a power-of-two number of
    leaves whose adds stay where they were made (no push-down).

    ``t[p]`` is the largest value under node ``p`` less the adds pending on ``p``'s strict ancestors, and
    ``d[p]`` the adds made to the whole of ``p``'s range; so ``t[p] = max(t[2p], t[2p+1]) + d[p]``.  A query
    collects the nodes covering its range and adds the ``d`` of their ancestors on the way up (every node
    collected on the left lies under the node just left of the boundary, every one on the right under the
    boundary node itself), a point update stops climbing as soon as an ancestor's value does not change:
    each operation is one walk up the tree, without writes for a query.
    """

    __slots__ = ("n", "size", "t", "d")

    def __init__(self, values: list[int]):
        n = max(1, len(values))
        size = 1 << (n - 1).bit_length()
        self.n = n
        self.size = size
        t = [EMPTY_MAX] * (2 * size)
        t[size : size + len(values)] = values
        for i in range(size - 1, 0, -1):
            a, b = t[2 * i], t[2 * i + 1]
            t[i] = a if a > b else b
        self.t = t
        self.d = [0] * (2 * size)  # adds to whole subtrees (a leaf's own is in ``t``; d[0] stays 0)

    def add(self, lo: int, hi: int, v: int) -> None:
        """Add ``v`` to positions lo..hi-1."""
        if lo >= hi or not v:
            return
        t, d = self.t, self.d
        size = self.size
        lo += size
        hi += size
        if hi - lo == 1:
            self.add_point(lo - size, v)
            return
        l0, r0 = lo >> 1, (hi - 1) >> 1
        while lo < hi:
            if lo & 1:
                t[lo] += v
                d[lo] += v
                lo += 1
            if hi & 1:
                hi -= 1
                t[hi] += v
                d[hi] += v
            lo >>= 1
            hi >>= 1
        # the ancestors of the two ends (the only nodes above a changed one), up to where the paths meet
        while l0 != r0:
            a, b = t[2 * l0], t[2 * l0 + 1]
            t[l0] = (a if a > b else b) + d[l0]
            a, b = t[2 * r0], t[2 * r0 + 1]
            t[r0] = (a if a > b else b) + d[r0]
            l0 >>= 1
            r0 >>= 1
        while l0:
            a, b = t[2 * l0], t[2 * l0 + 1]
            t[l0] = (a if a > b else b) + d[l0]
            l0 >>= 1

    def add_point(self, i: int, v: int) -> None:
        """Add ``v`` to position ``i``."""
        t, d = self.t, self.d
        p = i + self.size
        t[p] += v
        p >>= 1
        while p:
            a, b = t[2 * p], t[2 * p + 1]
            top = (a if a > b else b) + d[p]
            if top == t[p]:  # nothing above changes either
                return
            t[p] = top
            p >>= 1

    def value(self, i: int) -> int:
        """The value at position ``i``."""
        t, d = self.t, self.d
        p = i + self.size
        res = t[p]
        p >>= 1
        while p:
            res += d[p]
            p >>= 1
        return res

    def max(self, lo: int, hi: int) -> int:
        """Largest value at positions lo..hi-1 (``EMPTY_MAX`` when the range is empty)."""
        if lo >= hi:
            return EMPTY_MAX
        t, d = self.t, self.d
        size = self.size
        lo += size
        hi += size
        left = right = EMPTY_MAX
        while lo < hi:
            if lo & 1:
                if t[lo] > left:
                    left = t[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                if t[hi] > right:
                    right = t[hi]
            lo >>= 1
            hi >>= 1
            # what was collected lies under node lo - 1 (left) and node hi (right) of the level above
            left += d[lo - 1]
            right += d[hi]
        lo -= 1
        while lo > 1:
            lo >>= 1
            left += d[lo]
        while hi > 1:
            hi >>= 1
            right += d[hi]
        res = left if left > right else right
        return res if res > EMPTY_MAX // 2 else EMPTY_MAX


class HeadroomTree:
    """Range add / range max over positions 0..n-1: blocks of ``block`` positions in a flat list, plus a
    ``RangeMaxTree`` over the blocks for the whole blocks a range covers.

    The value at position i is ``raw[i]`` plus the adds made to its whole block through the block tree (the
    block's *offset*).  The block tree holds, per block, ``written[b]`` (the largest raw value of the block
    when it was last written back) plus the offset; ``dirty`` lists the blocks whose raw values changed since.
    """

    __slots__ = ("n", "block", "raw", "blocks", "written", "dirty", "is_dirty", "offset", "offset_epoch", "epoch")

    def __init__(self, values: list[int], block: int = HEADROOM_BLOCK):
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        n = len(values)
        self.n = n
        self.block = block
        self.raw = list(values)
        self.written = [max(values[s : s + block]) for s in range(0, n, block)]
        self.blocks = RangeMaxTree(self.written)
        nb = len(self.written)
        self.dirty: list[int] = []
        self.is_dirty = bytearray(nb)
        # offsets read back from the block tree, valid while ``offset_epoch[b] == epoch`` (``epoch`` counts the
        # adds made through the block tree, the only thing that changes an offset)
        self.offset = [0] * nb
        self.offset_epoch = [-1] * nb
        self.epoch = 0

    def _offset(self, b: int) -> int:
        if self.offset_epoch[b] != self.epoch:
            # the block tree holds written[b] + offset whether or not the block is dirty
            self.offset[b] = self.blocks.value(b) - self.written[b]
            self.offset_epoch[b] = self.epoch
        return self.offset[b]

    def _flush(self) -> None:
        """Write the changed blocks' largest raw values back to the block tree."""
        raw, block, written, blocks = self.raw, self.block, self.written, self.blocks
        for b in self.dirty:
            top = max(raw[b * block : (b + 1) * block])
            if top != written[b]:
                blocks.add_point(b, top - written[b])
                written[b] = top
            self.is_dirty[b] = 0
        self.dirty.clear()

    def _add_inside(self, b: int, lo: int, hi: int, v: int) -> None:
        raw = self.raw
        raw[lo:hi] = map(operator.add, raw[lo:hi], repeat(v))  # at C speed: no bytecode per position
        if not self.is_dirty[b]:
            self.is_dirty[b] = 1
            self.dirty.append(b)

    def add(self, lo: int, hi: int, v: int) -> None:
        """Add ``v`` to positions lo..hi-1."""
        if lo >= hi or not v:
            return
        block = self.block
        bl, bh = lo // block, (hi - 1) // block
        if bl == bh:
            if hi - lo == 1:  # the most common case
                self.raw[lo] += v
                if not self.is_dirty[bl]:
                    self.is_dirty[bl] = 1
                    self.dirty.append(bl)
            else:
                self._add_inside(bl, lo, hi, v)
            return
        self._add_inside(bl, lo, (bl + 1) * block, v)
        self._add_inside(bh, bh * block, hi, v)
        if bl + 1 < bh:
            self.blocks.add(bl + 1, bh, v)
            self.epoch += 1

    def add_within(self, lo: int, hi: int, v: int, limit: int) -> int:
        """``max(lo, hi)``, and ``add(lo, hi, v)`` when that max plus ``v`` is within ``limit``: the check and the
        charge of the scheduler's gates in one call (a range inside one block, the usual case, is sliced once)."""
        if lo >= hi:
            return EMPTY_MAX
        block, raw = self.block, self.raw
        bl = lo // block
        if bl != (hi - 1) // block:
            worst = self.max(lo, hi)
            if worst + v <= limit:
                self.add(lo, hi, v)
            return worst
        offset = self.offset[bl] if self.offset_epoch[bl] == self.epoch else self._offset(bl)
        if hi - lo == 1:
            worst = raw[lo] + offset
            if worst + v > limit or not v:
                return worst
            raw[lo] += v
        else:
            values = raw[lo:hi]
            worst = max(values) + offset
            if worst + v > limit or not v:
                return worst
            raw[lo:hi] = map(operator.add, values, repeat(v))
        if not self.is_dirty[bl]:
            self.is_dirty[bl] = 1
            self.dirty.append(bl)
        return worst

    def max(self, lo: int, hi: int) -> int:
        """Largest value at positions lo..hi-1 (``EMPTY_MAX`` when the range is empty)."""
        if lo >= hi:
            return EMPTY_MAX
        block, raw = self.block, self.raw
        bl, bh = lo // block, (hi - 1) // block
        if bl == bh:
            top = raw[lo] if hi - lo == 1 else max(raw[lo:hi])
            if self.offset_epoch[bl] == self.epoch:
                return top + self.offset[bl]
            return top + self._offset(bl)
        a = max(raw[lo : (bl + 1) * block]) + self._offset(bl)
        b = max(raw[bh * block : hi]) + self._offset(bh)
        res = a if a > b else b
        if bl + 1 < bh:
            self._flush()
            mid = self.blocks.max(bl + 1, bh)
            if mid > res:
                res = mid
        return res


__all__ = ["EMPTY_MAX", "HEADROOM_BLOCK", "HeadroomTree", "RangeMaxTree"]
