"""Collectives in flight: per process group, the issued collectives whose first wait has not run yet (the
quantity ``max_prefetch`` caps).  Their timing is the simulator's ``StreamClock``, which this wraps.
"""

from __future__ import annotations

from collections import deque

from ..simulate.timeline import StreamClock
from .structure import Structure


class AsyncTracker:
    __slots__ = ("structure", "clock", "retired", "inflight", "count")

    def __init__(self, structure: Structure, clock: StreamClock):
        self.structure = structure
        self.clock = clock
        self.retired = bytearray(structure.n)
        self.inflight: dict[str, deque[int]] = {g: deque() for g in structure.seq}
        self.count: dict[str, int] = {g: 0 for g in structure.seq}

    def issue(self, c: int) -> float:
        """Issue collective ``c`` now; returns its simulated end."""
        structure = self.structure
        g = structure.group[c]
        end = self.clock.issue_collective(c, g)
        if structure.waits_of[c]:  # a collective nobody waits on never completes in program order
            self.inflight[g].append(c)
            self.count[g] += 1
        return end

    def retire(self, c: int) -> None:
        """The first wait of ``c`` has run: it no longer counts as in flight."""
        if self.clock.issued[c] and not self.retired[c] and self.structure.waits_of[c]:
            self.retired[c] = 1
            self.count[self.structure.group[c]] -= 1

    def oldest(self, group: str) -> int:
        """The earliest-issued collective of ``group`` still in flight, or -1."""
        q = self.inflight[group]
        while q and self.retired[q[0]]:
            q.popleft()
        return q[0] if q else -1
