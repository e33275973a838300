"""Replay an order on one compute stream plus one FIFO stream per process group.

- A non-collective node occupies the compute stream for its duration, in order.
- A collective costs the compute stream nothing: it is issued when the compute stream reaches it and runs on
  its group's stream, starting when both it is issued and the group's previous collective has finished.
- A wait first blocks the compute stream until its collective has finished (that blocked time is the
  collective's exposed time), then takes its own duration (normally 0) like any compute node.
- A collective nobody waits on is exposed by however long it runs past the end of the compute stream.

With ``OverlapCosts`` (a cluster profile's overlap terms, see ``CostModel.overlap_costs``) two more rules
apply: issuing a collective holds the compute stream for ``issue_ms`` before the collective can start, and
compute that runs while any collective is in flight progresses ``1 + compute_slowdown`` times slower for as
long as the collectives run (the rest of the node runs at full speed).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..dag.graph import Dag, NodeKind
from .bounds import lower_bound
from .overlap_costs import OverlapCosts
from .memory import memory_curve, wait_collectives


def slowed_end(t: float, work: float, comm_until: float, slowdown: float) -> float:
    """End of ``work`` ms of compute started at ``t`` that runs ``1 + slowdown`` times slower until
    ``comm_until`` (while collectives are in flight) and at full speed after."""
    if slowdown <= 0.0 or comm_until <= t or work <= 0.0:
        return t + work
    stretched = work * (1.0 + slowdown)
    if t + stretched <= comm_until:
        return t + stretched
    done_while_slow = (comm_until - t) / (1.0 + slowdown)
    return comm_until + (work - done_while_slow)


def group_key(group_name: str | None) -> str:
    """Stream name of a collective's process group (unnamed groups share one stream, as in the DAG)."""
    return group_name or "?"


@dataclass
class Timeline:
    """Result of ``simulate``.  Times in ms from the start of the graph; lists are indexed by node id.

    issue: when the compute stream reached the node (for a collective, when it was issued; for a wait,
        when it started blocking).
    start / end: when the node ran (a collective: on its group's stream; a wait: from ``issue`` until the
        compute stream was released and its own duration was spent).
    exposed: per collective id, ms during which it held the compute stream up (0 when hidden).
    wait_blocked: per wait id, ms it blocked the compute stream.
    comm_time: per process group, total ms its stream was busy.
    memory: bytes live while each position of ``order`` runs (see ``memory_curve``).
    """

    order: list[int]
    issue: list[float]
    start: list[float]
    end: list[float]
    makespan: float
    compute_end: float
    compute_busy: float
    compute_idle: float
    exposed: dict[int, float]
    exposed_total: float
    wait_blocked: dict[int, float]
    comm_time: dict[str, float]
    memory: list[int] = field(repr=False)
    peak_memory: int
    lower_bound: float

    @property
    def comm_total(self) -> float:
        return sum(self.comm_time.values())

    def summary(self) -> dict[str, Any]:
        """Scalar figures for logs and dumps (JSON-serialisable)."""
        return {
            "makespan_ms": self.makespan,
            "lower_bound_ms": self.lower_bound,
            "compute_busy_ms": self.compute_busy,
            "compute_idle_ms": self.compute_idle,
            "exposed_comm_ms": self.exposed_total,
            "comm_ms": dict(self.comm_time),
            "peak_memory_bytes": self.peak_memory,
        }


def check_order(dag: Dag, order: Sequence[int]) -> None:
    """Raise ValueError, naming a node, unless ``order`` is a valid schedule of ``dag``."""
    n = len(dag.nodes)
    seen = bytearray(n)
    for i in order:
        if type(i) is not int:
            try:
                i = operator.index(i)  # numpy integers are fine
            except TypeError:
                raise ValueError(f"order entry {i!r} is not a node id") from None
        if not 0 <= i < n:
            raise ValueError(f"order names node {i}, outside 0..{n - 1}")
        if seen[i]:
            raise ValueError(f"order places node {dag.nodes[i].name} twice")
        seen[i] = 1
    if len(order) != n:
        missing = seen.index(0)
        raise ValueError(f"order leaves out node {dag.nodes[missing].name} ({n - len(order)} missing)")
    problems = dag.order_violations(order, limit=3)
    if problems:
        raise ValueError("invalid order: " + "; ".join(problems))


def check_durations(dag: Dag, durations: Sequence[float]) -> list[float]:
    """One finite, non-negative duration (ms) per node id, as floats; ValueError naming the node otherwise."""
    if len(durations) != len(dag.nodes):
        raise ValueError(f"{len(durations)} durations for {len(dag.nodes)} nodes")
    dur = [float(d) for d in durations]
    for i, d in enumerate(dur):
        if not (d >= 0.0 and math.isfinite(d)):
            raise ValueError(f"duration of {dag.nodes[i].name} is {d}, not a finite non-negative number")
    return dur


class StreamClock:
    """Simulated time of one compute stream and one FIFO stream per process group, advanced node by node
    with the rules above.  ``simulate`` replays a whole order with it; the reordering policy advances it
    while it builds an order, so its predictions are the simulator's.

    now: the compute stream's time; busy: time it spent running nodes; exposed_total: time it spent blocked
    on collectives (waits so far, plus ``finish``); per node id: issue / start / end as in ``Timeline``.
    overlap: the host issue time and compute slowdown of ``OverlapCosts`` (default: overlapping is free).
    """

    __slots__ = ("durations", "now", "busy", "exposed_total", "stream_end", "comm_time", "issue", "start", "end",
                 "issued", "exposed", "wait_blocked", "issue_ms", "slowdown")

    def __init__(self, durations: list[float], groups: Iterable[str] = (), overlap: OverlapCosts | None = None):
        if overlap is not None and not isinstance(overlap, OverlapCosts):
            raise ValueError(f"overlap: expected OverlapCosts or None, got {type(overlap).__name__}")
        n = len(durations)
        self.issue_ms = overlap.issue_ms if overlap is not None else 0.0
        self.slowdown = overlap.compute_slowdown if overlap is not None else 0.0
        self.durations = durations
        self.now = 0.0
        self.busy = 0.0
        self.exposed_total = 0.0
        self.stream_end: dict[str, float] = {g: 0.0 for g in groups}
        self.comm_time: dict[str, float] = {}
        self.issue = [0.0] * n
        self.start = [0.0] * n
        self.end = [0.0] * n
        self.issued = bytearray(n)
        self.exposed: dict[int, float] = {}
        self.wait_blocked: dict[int, float] = {}

    def stream_free(self, group: str) -> float:
        """When ``group``'s stream finishes everything issued so far."""
        return self.stream_end.get(group, 0.0)

    def issue_collective(self, c: int, group: str) -> float:
        """Collective ``c`` is issued now on ``group``'s stream; returns when it ends."""
        t = self.now
        self.issue[c] = t
        if self.issue_ms:  # the host is busy issuing it before it can start
            t += self.issue_ms
            self.busy += self.issue_ms
            self.now = t
        s = self.stream_end.get(group, 0.0)
        if s < t:
            s = t
        d = self.durations[c]
        e = s + d
        self.start[c] = s
        self.end[c] = e
        self.stream_end[group] = e
        self.comm_time[group] = self.comm_time.get(group, 0.0) + d
        self.exposed[c] = 0.0
        self.issued[c] = 1
        return e

    def run_wait(self, w: int, c: int) -> float:
        """Wait ``w`` on collective ``c`` runs now: it blocks until ``c`` ends, then takes its own duration.
        Returns the time it blocked."""
        t = self.now
        self.issue[w] = t
        self.start[w] = t
        ce = self.end[c]
        blocked = 0.0
        if ce > t:
            blocked = ce - t
            t = ce  # not t + blocked, which can land one ulp before the collective's end
        self.exposed[c] += blocked
        self.exposed_total += blocked
        self.wait_blocked[w] = blocked
        d = self.durations[w]
        if self.slowdown > 0.0:
            e = self._run(t, d)
        else:  # ``_run`` without overlap costs, inline: this runs once per node of every order simulated
            e = t + d
            self.busy += e - t
        self.end[w] = e
        self.now = e
        return blocked

    def run_compute(self, i: int) -> None:
        """Node ``i`` (not a collective, not a wait on one) runs now on the compute stream."""
        t = self.now
        self.issue[i] = t
        self.start[i] = t
        d = self.durations[i]
        if self.slowdown > 0.0:
            e = self._run(t, d)
        else:  # ``_run`` without overlap costs, inline
            e = t + d
            self.busy += e - t
        self.end[i] = e
        self.now = e

    def _run(self, t: float, work: float) -> float:
        """End of ``work`` ms of compute started at ``t``, slowed while collectives are in flight."""
        if self.slowdown > 0.0 and work > 0.0 and self.stream_end:
            end = slowed_end(t, work, max(self.stream_end.values()), self.slowdown)
        else:
            end = t + work
        self.busy += end - t
        return end

    def finish(self, unwaited: Iterable[int]) -> float:
        """The compute stream is done: the ``unwaited`` collectives (nobody waits on them) are exposed by
        however long they run past its end.  Returns the makespan."""
        compute_end = self.now
        for c in unwaited:
            if self.issued[c] and self.end[c] > compute_end:
                late = self.end[c] - compute_end
                self.exposed[c] = late
                self.exposed_total += late
        return max(compute_end, max(self.stream_end.values(), default=0.0))


def simulate(
    dag: Dag, order: Sequence[int], durations: Sequence[float], overlap: OverlapCosts | None = None
) -> Timeline:
    """Timeline of running ``dag`` in ``order`` with ``durations`` (ms per node id).

    ``overlap`` adds the host issue time of collectives and the compute slowdown while they run (see the
    module docstring); without it overlapping is free.

    Raises ValueError if ``order`` is not a permutation, breaks a dependency or changes the issue order of
    a process group's collectives (every rank must issue the same sequence).
    """
    check_order(dag, order)
    dur = check_durations(dag, durations)
    waited = wait_collectives(dag)
    clock, compute_end, makespan = _replay(dag, order, dur, waited, overlap)
    memory = memory_curve(dag, order, waited)
    return Timeline(
        order=list(order),
        issue=clock.issue,
        start=clock.start,
        end=clock.end,
        makespan=makespan,
        compute_end=compute_end,
        compute_busy=clock.busy,
        compute_idle=makespan - clock.busy,
        exposed=clock.exposed,
        exposed_total=_exposed_total(clock),
        wait_blocked=clock.wait_blocked,
        comm_time=clock.comm_time,
        memory=memory,
        peak_memory=max(memory, default=0),
        lower_bound=lower_bound(dag, dur),
    )


def _replay(
    dag: Dag, order: Sequence[int], dur: list[float], waited: Sequence[int], overlap: OverlapCosts | None
) -> tuple[StreamClock, float, float]:
    """Advance a ``StreamClock`` through ``order`` (already checked); returns it, the compute stream's end and
    the makespan."""
    nodes = dag.nodes
    clock = StreamClock(dur, overlap=overlap)
    collective = NodeKind.COLLECTIVE  # a local: reading an enum member off its class costs several times more
    for i in order:
        node = nodes[i]
        if node.kind is collective:
            clock.issue_collective(i, group_key(node.group_name))
            continue
        c = waited[i]
        if c >= 0:
            if not clock.issued[c]:
                raise ValueError(f"wait {node.name} runs before its collective {nodes[c].name}")
            clock.run_wait(i, c)
        else:
            clock.run_compute(i)
    compute_end = clock.now
    has_wait = bytearray(len(nodes))
    for c in waited:
        if c >= 0:
            has_wait[c] = 1
    makespan = clock.finish(c for c in clock.exposed if not has_wait[c])
    return clock, compute_end, makespan


def _exposed_total(clock: StreamClock) -> float:
    # summed per collective in issue order, so that every caller gets the same last digit
    return sum(clock.exposed.values())


def exposed_and_makespan(
    dag: Dag, order: Sequence[int], durations: list[float], waited: Sequence[int],
    overlap: OverlapCosts | None = None, groups: Sequence[str] | None = None,
) -> tuple[float, float]:
    """``(exposed_total, makespan)`` of ``simulate(dag, order, durations)``, equal to its figures, for a caller
    that has already checked ``order`` and ``durations`` (``check_order``, ``check_durations``) and holds
    ``wait_collectives(dag)``: it skips those checks and the timeline's other figures (per-node times, the
    memory curve, the lower bound).  ``groups``: per node id, a collective's ``group_key`` and "" for any other
    node, when the caller has them (the replay then reads no node)."""
    if groups is not None and (overlap is None or not (overlap.issue_ms or overlap.compute_slowdown)):
        return _exposed_and_makespan_free(dag, order, durations, waited, groups)
    clock, _, makespan = _replay(dag, order, durations, waited, overlap)
    return _exposed_total(clock), makespan


def _exposed_and_makespan_free(
    dag: Dag, order: Sequence[int], dur: list[float], waited: Sequence[int], groups: Sequence[str]
) -> tuple[float, float]:
    """``StreamClock``'s rules without overlap costs, written out in one loop: the same float operations in the
    same order as ``_replay`` (so the same figures to the last digit), without a call per node."""
    n = len(dur)
    end = [0.0] * n
    issued = bytearray(n)
    exposed = [0.0] * n  # per collective; summed in issue order below, as ``_exposed_total`` does
    issue_order: list[int] = []
    stream_end: dict[str, float] = {}
    now = 0.0
    for i in order:
        g = groups[i]
        if g:
            s = stream_end.get(g, 0.0)
            if s < now:
                s = now
            e = s + dur[i]
            end[i] = e
            stream_end[g] = e
            issued[i] = 1
            issue_order.append(i)
            continue
        c = waited[i]
        if c >= 0:
            if not issued[c]:
                raise ValueError(f"wait {dag.nodes[i].name} runs before its collective {dag.nodes[c].name}")
            ce = end[c]
            if ce > now:
                exposed[c] += ce - now
                now = ce
        now = now + dur[i]
    has_wait = set(waited)
    for c in issue_order:  # a collective nobody waits on is exposed by how long it runs past the compute stream
        if c not in has_wait and end[c] > now:
            exposed[c] = end[c] - now
    makespan = max(now, max(stream_end.values(), default=0.0))
    return sum(map(exposed.__getitem__, issue_order)), makespan
