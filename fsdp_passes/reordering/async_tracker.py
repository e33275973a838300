"""Collectives in flight: per process group, the FIFO stream's simulated end time and the issued collectives
whose wait has not run yet (the quantity ``max_prefetch`` caps).

Timing follows the simulator: a collective issued at compute time ``t`` starts at ``max(t, end of the
group's previous collective)``; its wait blocks the compute stream until it ends.
"""

from __future__ import annotations

from collections import deque

from .structure import Structure


class AsyncTracker:
    __slots__ = ("s", "dur", "stream_end", "end", "issued", "retired", "inflight", "count")

    def __init__(self, s: Structure, dur: list[float]):
        self.s = s
        self.dur = dur
        self.stream_end: dict[str, float] = {g: 0.0 for g in s.seq}
        self.end = [0.0] * s.n
        self.issued = bytearray(s.n)
        self.retired = bytearray(s.n)
        self.inflight: dict[str, deque[int]] = {g: deque() for g in s.seq}
        self.count: dict[str, int] = {g: 0 for g in s.seq}

    def stream_free(self, group: str) -> float:
        """When the group's stream finishes everything issued so far."""
        return self.stream_end[group]

    def issue(self, c: int, t: float) -> float:
        """Issue collective ``c`` at compute time ``t``; returns its simulated end."""
        g = self.s.group[c]
        start = self.stream_end[g]
        if start < t:
            start = t
        e = start + self.dur[c]
        self.stream_end[g] = e
        self.end[c] = e
        self.issued[c] = 1
        if self.s.waits_of[c]:  # a collective nobody waits on never completes in program order
            self.inflight[g].append(c)
            self.count[g] += 1
        return e

    def retire(self, c: int) -> None:
        """The first wait of ``c`` has run: it no longer counts as in flight."""
        if self.issued[c] and not self.retired[c] and self.s.waits_of[c]:
            self.retired[c] = 1
            self.count[self.s.group[c]] -= 1

    def oldest(self, group: str) -> int:
        """The earliest-issued collective of ``group`` still in flight, or -1."""
        q = self.inflight[group]
        while q and self.retired[q[0]]:
            q.popleft()
        return q[0] if q else -1
