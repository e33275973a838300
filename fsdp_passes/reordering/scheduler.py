"""The scheduling core: one forward list-scheduling pass over the DAG with simulated time.

State: the simulator's own engine advanced node by node as the order grows (``fsdp_passes.simulate``: a
``StreamClock``, the compute stream's time and each group's stream, and a ``MemoryTracker``, the exact live
bytes), so what the pass predicts for its order is what ``simulate`` reports; an ``AsyncTracker`` (collectives
in flight per group) and a ``HeadroomTree`` (the original order's memory curve plus the extra live ranges
committed to so far, by original position).

The *frontier* is the lowest-numbered compute node not yet scheduled.  Every step:

1. due collectives (ids below the frontier's: the original order issued them before it) are issued now, unconditionally
   (FSDP ones after freeing a ``max_prefetch`` slot if needed);
2. waits whose collective has finished in simulated time and whose running frees memory (or that nothing
   consumes) are placed, without blocking; this is what releases reduce-scatter inputs.  An all-gather's
   wait that something consumes is not: it stays where its first consumer needs it (step 5), so a transfer
   that runs later than predicted blocks only the compute that needs its result;
3. a compute node is chosen: the frontier if nothing it needs is still in flight; otherwise the
   lowest-numbered compute node whose inputs are all available now and that ends before the frontier's
   collectives do (it fills the gap without delaying the frontier), if the memory limit allows pulling it
   ahead; otherwise the frontier, blocking on its waits;
4. waits that were deferred past their original place and keep inputs alive are checked against the memory
   limit; the ones that no longer fit are placed now;
5. the chosen node's pending waits are placed (as late as possible: right before it);
6. collectives that are next in their group and whose inputs are ready are issued early (prefetch) if
   (a) their group's stream would otherwise go idle before the chosen node ends (issuing later would not
   start them later), (b) fewer than ``max_prefetch`` collectives of the group are in flight and (c) the
   extra live range of their output keeps the memory limit; collectives that are not FSDP-like skip (a)
   and (b).  A group's next FSDP-like collective that still needs compute (copy-in / cast kernels, its
   *feeders*) is prefetched the same way when those feeders can run now (every unscheduled ancestor is a
   compute node, at most ``MAX_FEEDERS`` of them, none is the frontier or the chosen node): the feeders are
   hoisted in id order, then it is issued.  Only one collective ahead (the previous one of the same op in
   its group is already being consumed, or the one before it when the block consuming it is shorter than
   the collective), never past a not-yet-issued collective that is not FSDP-like, and
   with the feeders' outputs charged to the memory limit too;
7. the chosen node runs.

Names: ``c`` is a collective, ``w`` a wait, ``g`` a process group's stream key, ``p`` / ``v`` a predecessor /
successor, ``r`` a buffer (by the id of the node that allocates it); the *chosen* node is the compute node
about to run.  Ids are the tie-break everywhere and all containers are heaps or arrays indexed by id, so the
result depends only on the DAG and the durations.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Optional

from ..dag.graph import CollectiveOp
from ..simulate.memory import MemoryModel, MemoryTracker
from ..simulate.timeline import OverlapCosts, StreamClock
from .async_tracker import AsyncTracker
from .headroom import HeadroomTree
from .structure import COLLECTIVE, COMPUTE, WAIT, Structure

#: how many ready compute nodes are tried, per step, when pulling one ahead of a blocked frontier
PULL_TRIES = 4

#: most unscheduled compute ancestors ("feeders") a collective may have for them to be hoisted so that it can
#: be prefetched; the ancestor search stops as soon as it would exceed this many nodes
MAX_FEEDERS = 64

#: how many earlier collectives of its group are looked at for the one-ahead horizon of a hoist
HORIZON_LOOKBACK = 8


class InternalError(RuntimeError):
    """The scheduler reached a state its invariants exclude (reported, and the original order is kept)."""


class ScheduleOutcome:
    """What one scheduling pass produced (internal; ``plan_order`` turns it into a ``ReorderResult``)."""

    __slots__ = ("order", "peak", "exposed", "makespan", "why", "gate", "pulled", "cap_exceeded", "hoisted")

    def __init__(self, order, peak, exposed, makespan, why, gate, pulled, cap_exceeded, hoisted=0):
        self.order: list[int] = order
        self.peak: int = peak
        self.exposed: float = exposed
        self.makespan: float = makespan
        self.why: list[str] = why  # per node: why it was placed where it was
        self.gate: list[str] = gate  # per collective: the last thing that held it back
        self.pulled: int = pulled
        self.cap_exceeded: int = cap_exceeded
        self.hoisted: int = hoisted  # compute nodes run early because they feed a prefetched collective


class ListScheduler:
    """One pass.  ``limit`` is the memory limit the gates use (None: no early issue, no pulling, no
    deferral of memory-holding waits past their original place: the conservative pass)."""

    def __init__(
        self,
        structure: Structure,
        memory_model: MemoryModel,
        base_curve: list[int],
        durations: list[float],
        *,
        limit: Optional[int],
        max_prefetch: Optional[int],
        overlap: Optional[OverlapCosts] = None,
    ):
        n = structure.n
        self.structure = structure
        self.durations = durations
        self.limit = limit
        self.max_prefetch = max_prefetch
        self.alloc = memory_model.alloc
        self.memory = MemoryTracker(memory_model)
        self.tree = HeadroomTree(base_curve) if limit is not None else None
        self.clock = StreamClock(durations, structure.seq, overlap)
        self.in_flight = AsyncTracker(structure, self.clock)
        self.order: list[int] = []
        self.scheduled = bytearray(n)
        self.pending = bytearray(n)  # waits whose inputs are all issued/placed, not placed themselves
        self.unmet = [len(p) for p in structure.preds]
        self.release = [0.0] * n  # compute: when its pending waits' collectives end
        self.clear: list[int] = []  # available compute, nothing in flight it needs
        self.blocked: list[tuple[float, int]] = []  # available compute, (release, id)
        self.finishing: list[tuple[float, int]] = []  # pending waits by (collective end, id)
        self.slow: list[tuple[float, int]] = []  # finished pending waits that take compute time
        # FSDP reductions' waits held until the next block's reduction is issued: that one's id -> the waits;
        # per wait, whether it was held (for its ``why``)
        self.held_for_next: dict[int, list[int]] = {}
        self.released_by_next = bytearray(n)
        self.filling = False
        self.overdue_heap: list[int] = []  # pending waits by id
        self.overdue: list[int] = []  # pending waits past their original position (and some placed since)
        self.n_overdue = 0  # how many of them are not placed
        self.hold_from = [0] * n  # per wait: first position its hold is not yet charged on (0: its own + 1)
        self.is_overdue = bytearray(n)
        self.held_by_overdue = [0] * memory_model.n_buffers  # per buffer: how many of its remaining users are overdue waits
        # ``_check_holds``' group: the first ``holds_count`` overdue waits, charged up to ``holds_at`` (their
        # ``hold_from``, written lazily), holding ``holds_total`` bytes together; valid (``holds_valid``) while no
        # user of a buffer they hold but themselves has run and no wait sharing a buffer with them became overdue
        self.holds_valid = False
        self.holds_at = -1
        self.holds_total = 0
        self.holds_count = 0
        # collectives next in their group with inputs ready: (FSDP-like?, id), so that collectives that are
        # not FSDP-like are issued first and get the memory headroom first
        self.candidates: list[tuple[int, int]] = []
        self.in_candidates = bytearray(n)
        self.next_seq_pos: dict[str, int] = {g: 0 for g in structure.seq}  # per group: index of its next collective
        self.why = [""] * n
        self.gate = [""] * n
        self.pulled = 0
        self.hoisted = 0
        self.cap_exceeded = 0
        # feeder search cache, per collective: the unscheduled compute ancestors found by the last search
        # (None: the search failed); the search is redone only once ``feeder_retry[c]`` says it may succeed
        self.feeders: dict[int, Optional[list[int]]] = {}
        self.feeder_retry: dict[int, tuple[int, int]] = {}  # c -> (node that blocked it or -1, order length)
        # collectives not worth a hoist attempt until a node is placed: c -> (that node, or also when it is
        # the chosen node?, or with node -1: until so many nodes are scheduled)
        self.parked: dict[int, tuple[int, bool, int]] = {}
        # compute_before[i]: summed duration of the compute nodes with ids below i (the original order's
        # compute time up to node i), for the hoisting horizon
        self.compute_before = [0.0] * (n + 1)
        kind = structure.kind
        for i in range(n):
            self.compute_before[i + 1] = self.compute_before[i] + (durations[i] if kind[i] == COMPUTE else 0.0)
        self.due_ptr = 0

    # -- readiness ------------------------------------------------------------------------------------------
    def _push_cand(self, c: int) -> None:
        if not self.in_candidates[c]:
            self.in_candidates[c] = 1
            heapq.heappush(self.candidates, (self.structure.fsdp[c], c))

    def _available(self, i: int) -> None:
        """``i`` has every input placed, issued or pending: file it where the scheduler will look for it."""
        structure = self.structure
        kind = structure.kind
        stack = [i]
        while stack:
            i = stack.pop()
            k = kind[i]
            if k == COMPUTE:
                r = 0.0
                end = self.clock.end
                for p in structure.preds[i]:
                    if self.pending[p]:
                        e = end[structure.coll_of[p]]
                        if e > r:
                            r = e
                self.release[i] = r
                if r <= self.clock.now:
                    heapq.heappush(self.clear, i)
                else:
                    heapq.heappush(self.blocked, (r, i))
            elif k == WAIT:
                self.pending[i] = 1
                heapq.heappush(self.finishing, (self.clock.end[structure.coll_of[i]], i))
                heapq.heappush(self.overdue_heap, i)
                unmet = self.unmet
                for v in structure.succs[i]:
                    unmet[v] -= 1
                    if unmet[v] == 0:
                        stack.append(v)
            else:
                if structure.seq_pos[i] == self.next_seq_pos[structure.group[i]]:
                    self._push_cand(i)

    def _place(self, i: int) -> None:
        if self.scheduled[i]:  # already placed while filling idle time
            return
        structure = self.structure
        kind = structure.kind[i]
        if kind == COMPUTE:
            self._run_compute(i)
            return
        if kind == COLLECTIVE:
            g = structure.group[i]
            if structure.seq_pos[i] != self.next_seq_pos[g]:
                raise InternalError(f"{structure.names[i]} would change the collective order of group {g!r}")
            self.in_flight.issue(i)
            self.next_seq_pos[g] += 1
            held = self.held_for_next.pop(i, None)
            if held:
                for w in held:
                    if not self.scheduled[w]:
                        self.released_by_next[w] = 1
                        heapq.heappush(self.finishing, (self.clock.end[structure.coll_of[w]], w))
        elif kind == WAIT:
            c = structure.coll_of[i]
            end = self.clock.end[c]
            if end > self.clock.now and not self.filling and (self.finishing or self.slow):
                # about to block: first run the waits that can use the idle time
                self.filling = True
                try:
                    self._release_finished(horizon=end)
                finally:
                    self.filling = False
                if self.scheduled[i]:
                    return
            self.clock.run_wait(i, c)
            self.in_flight.retire(c)
            self.pending[i] = 0
            if self.is_overdue[i]:
                self.n_overdue -= 1
                held = self.held_by_overdue
                rs = self.memory.uses[i]
                if self.holds_valid:
                    # a wait of the group that shares no buffer with another overdue wait leaves the group with
                    # what it held less its own part (the buffers it charged: no other user remains)
                    remaining = self.memory.remaining
                    buffer_bytes = self.memory.buffer_bytes
                    mine = 0
                    for r in rs:
                        if held[r] != 1:
                            self.holds_valid = False
                        elif remaining[r] == 1:
                            mine += buffer_bytes[r]
                    self.holds_total -= mine
                for r in rs:
                    held[r] -= 1
        self._run_memory(i)
        self.scheduled[i] = 1
        self.order.append(i)
        if kind != WAIT:  # a wait released its consumers when it became pending
            unmet = self.unmet
            for v in structure.succs[i]:
                unmet[v] -= 1
                if unmet[v] == 0:
                    self._available(v)
        if kind == COLLECTIVE:
            nxt = structure.next_in_group(i)
            if nxt >= 0 and self.unmet[nxt] == 0 and not self.scheduled[nxt]:
                self._push_cand(nxt)

    def _run_memory(self, i: int) -> None:
        """Node ``i`` runs now: the memory tracker's step, and whether what the overdue waits hold may change."""
        memory = self.memory
        memory.run(i)
        if self.holds_valid:
            held = self.held_by_overdue
            for r in memory.uses[i]:
                if held[r]:  # a buffer an overdue wait holds has one user less: what it holds may change
                    self.holds_valid = False
                    break

    def _run_compute(self, i: int) -> None:
        """``_place`` for a compute node (most nodes), with its successors that become available filed here when
        they are compute nodes too."""
        clock = self.clock
        clock.run_compute(i)
        self._run_memory(i)
        self.scheduled[i] = 1
        self.order.append(i)
        structure = self.structure
        unmet = self.unmet
        kind = structure.kind
        for v in structure.succs[i]:
            u = unmet[v] - 1
            unmet[v] = u
            if u:
                continue
            if kind[v] != COMPUTE:
                self._available(v)
                continue
            # ``_available`` for a compute node
            r = 0.0
            pending = self.pending
            end = clock.end
            for p in structure.preds[v]:
                if pending[p]:
                    e = end[structure.coll_of[p]]
                    if e > r:
                        r = e
            self.release[v] = r
            if r <= clock.now:
                heapq.heappush(self.clear, v)
            else:
                heapq.heappush(self.blocked, (r, v))

    def _place_deps(self, node: int, why: str) -> None:
        """Place the pending waits ``node`` still needs (and theirs), in id order; each gets the reason
        ``why`` followed by ``node``'s name (built only when there is something to place: this runs for every
        node)."""
        structure = self.structure
        scheduled = self.scheduled
        preds = structure.preds[node]
        for p in preds:  # usually every input is placed already: nothing to build
            if not scheduled[p]:
                break
        else:
            return
        stack = [p for p in preds if not scheduled[p]]
        why = f"{why} {structure.names[node]}"
        todo: list[int] = []
        seen: set[int] = set()
        while stack:
            p = stack.pop()
            if p in seen or scheduled[p]:
                continue
            seen.add(p)
            if not self.pending[p]:
                raise InternalError(f"{structure.names[node]} needs {structure.names[p]}, which cannot run yet")
            todo.append(p)
            stack.extend(q for q in structure.preds[p] if not scheduled[q])
        todo.sort()
        for p in todo:
            self._place(p)
            if not self.why[p]:
                self.why[p] = why

    # -- step parts -------------------------------------------------------------------------------------------
    def _make_room(self, g: str, blocking: bool) -> bool:
        """Bring group ``g`` below ``max_prefetch`` in flight by placing its oldest collectives' waits.

        Non-blocking: only waits whose collective has already finished in simulated time."""
        in_flight = self.in_flight
        max_prefetch = self.max_prefetch
        while in_flight.count[g] >= max_prefetch:
            oldest = in_flight.oldest(g)
            if oldest < 0:
                break
            waits = [w for w in self.structure.waits_of[oldest] if not self.scheduled[w]]
            if not waits or not all(self.pending[w] for w in waits):
                return False
            if not blocking and self.clock.end[oldest] > self.clock.now:
                return False
            for w in waits:
                self._place_deps(w, "needed by")
                self._place(w)
                if not self.why[w]:
                    self.why[w] = f"early: frees a max_prefetch={max_prefetch} slot of group {g!r}"
        return in_flight.count[g] < max_prefetch

    def _check_holds(self, upto: int) -> None:
        """Pending waits whose original position is before ``upto`` (overdue) keep buffers alive that the
        original order had freed by then: the buffers whose remaining users are all overdue waits.  Charge
        that memory up to ``upto``, or place the wait now if the limit says no.

        The waits charged by earlier calls (the *group*: ``holds_count`` first entries of ``overdue``, charged
        up to ``holds_at``, ``holds_total`` bytes in all) are charged again as one range while what they hold
        has not changed (``holds_valid``); only the waits that became overdue since are looked at one by one."""
        overdue_heap = self.overdue_heap
        scheduled = self.scheduled
        uses = self.memory.uses
        held = self.held_by_overdue
        overdue = self.overdue
        while overdue_heap and overdue_heap[0] < upto:
            w = heapq.heappop(overdue_heap)
            if not scheduled[w]:
                overdue.append(w)
                self.n_overdue += 1
                self.is_overdue[w] = 1
                for r in uses[w]:
                    if held[r]:  # shared with a wait already overdue: what that one holds may change
                        self.holds_valid = False
                    held[r] += 1
        if not self.n_overdue:
            if overdue:  # all placed: they hold nothing any more
                self.overdue = []
                self.holds_valid = True
                self.holds_at = -1
                self.holds_total = self.holds_count = 0
            return
        tree = self.tree
        limit = self.limit
        hold_from = self.hold_from
        hold_hi = upto + 1
        at = self.holds_at
        start = 0  # the waits before this one are the group, charged up to ``hold_hi`` already
        if self.holds_valid:
            group = self.holds_count
            if hold_hi <= at:
                if group == len(overdue):
                    return  # nothing to charge: every hold reaches ``upto`` already
            else:
                # the group holds what it held when last charged, and would be charged over at..upto as one
                # range, all fitting or none changed
                total = self.holds_total
                if not total or (tree is not None and tree.add_within(at, hold_hi, total, limit) + total <= limit):  # type: ignore[operator]
                    self.holds_at = hold_hi
                    if group == len(overdue):
                        return
                    start = group
        if not start and at >= 0:  # write back the group's lazily kept hold positions
            for k in range(self.holds_count):
                hold_from[overdue[k]] = at
            self.holds_at = -1
        self.holds_valid = False  # while waits are looked at one by one (and placed)
        every = True  # every kept wait was charged or found holding nothing here: the next group
        placed = False
        total = 0
        keep = [w for w in overdue[:start] if not scheduled[w]] if start else []
        group = len(keep)
        remaining = self.memory.remaining
        buffer_bytes = self.memory.buffer_bytes
        charged: set[int] = set()  # buffers already charged in this call (held by several waits)
        # Most holds extend over the same positions (those since the last check).  Charges to one range are
        # summed and added to the tree once: after adding ``acc`` to every position of a range, its max is the
        # max read before plus ``acc``, so each wait is checked exactly as if charged one by one.
        run_lo = run_hi = -1
        run_max = acc = 0
        for k in range(start, len(overdue)):
            w = overdue[k]
            if scheduled[w]:
                continue
            hold_lo = hold_from[w] or w + 1
            if hold_lo >= hold_hi:
                keep.append(w)
                every = False
                continue
            rs = uses[w]
            if len(rs) == 1:  # the usual case (a reduce-scatter's input): no list to build
                r = rs[0]
                mine = rs
                nbytes = buffer_bytes[r] if remaining[r] == held[r] and r not in charged else 0
            else:
                mine = []
                nbytes = 0
                for r in rs:
                    if remaining[r] == held[r] and r not in charged:
                        mine.append(r)
                        nbytes += buffer_bytes[r]
            if nbytes == 0:
                hold_from[w] = hold_hi
                keep.append(w)
                continue
            if tree is not None:
                if hold_lo != run_lo or hold_hi != run_hi:
                    if acc:
                        tree.add(run_lo, run_hi, acc)
                    run_lo, run_hi, acc = hold_lo, hold_hi, 0
                    run_max = tree.max(hold_lo, hold_hi)
                if run_max + acc + nbytes <= limit:  # type: ignore[operator]
                    acc += nbytes
                    total += nbytes
                    hold_from[w] = hold_hi
                    charged.update(mine)
                    keep.append(w)
                    continue
            placed = True
            self._place_deps(w, "needed by")
            self._place(w)
            if not self.why[w]:
                self.why[w] = f"early: keeping {nbytes} B of inputs alive longer would exceed the memory limit"
        if acc:
            tree.add(run_lo, run_hi, acc)  # type: ignore[union-attr]
        self.overdue = keep
        if every and not placed:
            self.holds_valid = True
            self.holds_at = hold_hi
            self.holds_total = (self.holds_total if start else 0) + total
            self.holds_count = len(keep)
        elif start:  # the group was charged up to ``hold_hi`` above: write its positions back
            for k in range(group):
                hold_from[keep[k]] = hold_hi
            self.holds_at = -1

    def _issue_due(self, frontier: int) -> None:
        structure = self.structure
        cols = structure.collectives
        while self.due_ptr < len(cols) and cols[self.due_ptr] < frontier:
            c = cols[self.due_ptr]
            self.due_ptr += 1
            if self.scheduled[c]:
                continue
            self._check_holds(c)
            self._place_deps(c, "needed by collective")
            if self.max_prefetch is not None and structure.fsdp[c]:
                if not self._make_room(structure.group[c], blocking=True):
                    self.cap_exceeded += 1
            self._place(c)
            self.why[c] = "at its original place"

    def _release_finished(self, horizon: Optional[float] = None) -> None:
        """Place pending waits that free memory or that nothing consumes, once their collective has finished.

        A wait that takes compute time of its own is compute work: it is only run early in time the compute
        stream would spend blocked anyway.  With ``horizon`` (the stream is about to block until then), waits
        finishing by ``horizon`` are placed first, if their own duration fits before it."""
        finishing = self.finishing
        slow = self.slow
        durations = self.durations
        scheduled = self.scheduled
        if horizon is not None:
            # first the waits that take time, while the stream is still free to run them before ``horizon``
            late: list[tuple[float, int]] = []
            while slow and slow[0][0] <= horizon and len(late) < PULL_TRIES:
                e, w = heapq.heappop(slow)
                if scheduled[w]:
                    continue
                if max(self.clock.now, e) + durations[w] > horizon:
                    late.append((e, w))
                    continue
                self._release(w, idle=True)
            for item in late:
                heapq.heappush(slow, item)
        limit = self.clock.now if horizon is None else horizon
        while finishing and finishing[0][0] <= limit:
            e, w = heapq.heappop(finishing)
            if scheduled[w]:
                continue
            if durations[w] > 0.0:
                if horizon is not None and max(self.clock.now, e) + durations[w] <= horizon:
                    self._release(w, idle=True)
                else:
                    heapq.heappush(slow, (e, w))
                continue
            self._release(w)

    def _release(self, w: int, idle: bool = False) -> None:
        """Place finished wait ``w`` if that frees memory, if nothing consumes it, or (``idle``) if its own
        duration runs in time the compute stream would otherwise spend blocked; an all-gather's wait that
        something consumes only in the last case."""
        structure = self.structure
        consumed = bool(structure.succs[w])
        c = structure.coll_of[w]
        if consumed and not idle and structure.coll_op[c] is CollectiveOp.ALL_GATHER:
            # it stays before its first consumer: placed at its predicted finish, a transfer later than
            # predicted would block compute that does not need it
            return
        nxt = structure.next_block_reduction[c]
        if nxt >= 0 and not idle and not self.scheduled[nxt] and self.tree is not None:
            # an FSDP reduction's wait waits for the next block's reduction to be issued (a block of slack, as
            # FSDP2 waits on reduce-scatter i when it issues i-1): placed at the predicted finish, a transfer
            # slower than predicted blocks compute; the memory limit still places it earlier (overdue waits)
            self.held_for_next.setdefault(nxt, []).append(w)
            return
        freed = self.memory.frees_if_run(w)
        if freed > 0 or idle or not consumed:
            self._place_deps(w, "needed by")
            self._place(w)
            if not self.why[w]:
                if freed and self.released_by_next[w]:
                    self.why[w] = (f"once the next block's reduction was issued (its collective finished): "
                                   f"frees {freed} B")
                elif freed:
                    self.why[w] = f"when its collective finished: frees {freed} B"
                elif idle:
                    self.why[w] = "when its collective finished: runs while the compute stream would block"
                else:
                    self.why[w] = "when its collective finished: nothing consumes it"

    def _pull(self, frontier: int) -> int:
        """The frontier waits on a collective still in flight: fill the gap with ready work that ends before
        the frontier could start anyway (so the frontier is never delayed), if memory allows."""
        clear, scheduled = self.clear, self.scheduled
        now = self.clock.now
        structure = self.structure
        region_lo = structure.region_start[frontier]
        gap_end = self._release_time(frontier)
        rejected: list[int] = []
        pick = frontier
        for _ in range(PULL_TRIES):
            if not clear:
                break
            candidate = heapq.heappop(clear)
            if scheduled[candidate]:
                continue
            nbytes = self.alloc[candidate]
            if now + self.durations[candidate] > gap_end or self._delays_non_fsdp(frontier, candidate):
                rejected.append(candidate)
                continue
            if not self._reserve(region_lo, candidate, nbytes, live=self.memory.live):
                pick = candidate
                self.pulled += 1
                self.why[candidate] = f"pulled ahead of {structure.names[frontier]}, which waits on {self._blocker(frontier)}"
                break
            rejected.append(candidate)
        for candidate in rejected:
            heapq.heappush(clear, candidate)
        return pick

    def _delays_non_fsdp(self, frontier: int, candidate: int) -> bool:
        """Would running compute node ``candidate`` now put it before a not-yet-issued collective that is not
        FSDP-like (TP, EP, barrier-like) and came before ``candidate`` originally?  Such collectives keep their
        position relative to compute: pulling ``candidate`` ahead of them would issue them one compute node later."""
        ids = self.structure.non_fsdp_collectives
        if not ids:
            return False
        scheduled = self.scheduled
        for k in range(bisect.bisect_right(ids, frontier), bisect.bisect_left(ids, candidate)):
            if not scheduled[ids[k]]:
                return True
        return False

    def _release_time(self, node: int) -> float:
        """When the collectives behind ``node``'s pending waits end (0 when none)."""
        structure = self.structure
        r = 0.0
        for p in structure.preds[node]:
            if self.pending[p]:
                e = self.clock.end[structure.coll_of[p]]
                if e > r:
                    r = e
        return r

    def _blocker(self, frontier: int) -> str:
        structure = self.structure
        best, best_end = -1, -1.0
        for p in structure.preds[frontier]:
            if self.pending[p] and self.clock.end[structure.coll_of[p]] > best_end:
                best, best_end = structure.coll_of[p], self.clock.end[structure.coll_of[p]]
        return structure.names[best] if best >= 0 else "a collective"

    def _issue_ready(self, frontier: int, chosen: int, fence: int) -> None:
        """Issue the candidates (next in their group, inputs ready) that the gates let through."""
        structure = self.structure
        scheduled = self.scheduled
        t_next = max(self.clock.now, self.release[chosen]) + self.durations[chosen]
        candidates = self.candidates
        retry: list[int] = []
        while candidates:
            _, c = heapq.heappop(candidates)
            self.in_candidates[c] = 0
            if scheduled[c] or structure.seq_pos[c] != self.next_seq_pos[structure.group[c]]:
                continue
            if structure.fence[c]:
                why = "barrier-like collective: kept at its original place"
            elif c > fence:
                why = f"not moved across barrier-like collective {structure.names[fence]}"
            else:
                why = self._gate(c, frontier, t_next)
            if why:
                self.gate[c] = why
                retry.append(c)
                continue
            self._place_deps(c, "needed by collective")
            self._place(c)
            self.why[c] = "prefetched" if structure.fsdp[c] else "not FSDP-like: issued as soon as its inputs were ready"
        for c in retry:
            self._push_cand(c)

    # -- hoisting the feeders of a prefetch -----------------------------------------------------------------
    def _hoist_one(self, frontier: int, chosen: int, fence: int) -> bool:
        """Try, in id order, each group's next collective that is FSDP-like and waits only on compute that
        could run now (its *feeders*); hoist the feeders and issue it for the first one the gates allow."""
        structure = self.structure
        heads = []
        for g, seq in structure.seq.items():
            k = self.next_seq_pos[g]
            if k < len(seq):
                c = seq[k]
                if self.unmet[c] and structure.fsdp[c] and not structure.fence[c] and c <= fence:
                    heads.append(c)
        heads.sort()
        scheduled = self.scheduled
        parked = self.parked
        feeders = self.feeders
        for c in heads:
            if c in parked:
                # nothing can change until this node is placed (or, for the horizon, is about to run)
                node, at_x, until = parked[c]
                if node >= 0:
                    if not scheduled[node] and not (at_x and node == chosen):
                        continue
                elif len(self.order) < until:
                    continue
                del parked[c]
            found = feeders.get(c)
            if found:
                # fast path for chains, where the frontier is the first feeder step after step
                k = 0
                while k < len(found) and scheduled[found[k]]:
                    k += 1
                if k:
                    found = feeders[c] = found[k:]
                if found and found[0] == frontier:
                    parked[c] = (frontier, False, 0)
                    continue
            u = self._beyond_horizon(c, chosen)
            if u >= 0:
                parked[c] = (u, True, 0)  # the normal state of a collective more than one ahead: no gate
                continue
            why = self._hoist(c, frontier, chosen)
            if not why:
                return True
            if why != "-":
                self.gate[c] = why
        return False

    def _beyond_horizon(self, c: int, chosen: int) -> int:
        """Hoisting moves compute, so it looks one collective ahead only: the feeders of ``c`` may be hoisted
        once the compute has started consuming the previous collective of the same op in its group (its
        first consumer has run or is ``chosen``, about to run), i.e. during the block before ``c``'s.  A previous
        collective whose consumption starts less than ``c``'s own duration of compute before ``c``'s first
        consumer (in the original order) is looked past: that block is too short to hide ``c``.  Collectives
        nobody consumes (gradient reductions whose result is a graph output) are skipped when looking back
        (at most ``HORIZON_LOOKBACK`` of them).  Returns the consumer still to come, or -1 when ``c`` is
        within the horizon."""
        structure = self.structure
        seq = structure.seq[structure.group[c]]
        op = structure.coll_op[c]
        use = structure.first_use[c]
        compute_before = self.compute_before
        k = structure.seq_pos[c] - 1
        stop = max(-1, k - HORIZON_LOOKBACK)
        while k > stop:
            p = seq[k]
            k -= 1
            if structure.coll_op[p] is not op:
                continue
            u = structure.first_use[p]
            if u < 0:
                continue
            if use >= 0 and compute_before[use] - compute_before[u] < self.durations[c]:
                # the block consuming p is shorter than c itself (a norm's weight right before the output
                # projection's): it cannot hide c, the block before it can
                continue
            return -1 if self.scheduled[u] or u == chosen else u
        return -1

    def _feeders_of(self, c: int) -> Optional[list[int]]:
        """The unscheduled ancestors of collective ``c``, ascending, if they are all compute nodes (so that
        they can run now, in id order) and at most ``MAX_FEEDERS``; None otherwise.  Only a leading run of
        scheduled nodes is dropped here: the caller filters the rest (``_hoist`` does so only past its cheap
        checks, since on a chain the frontier is usually the first feeder and this runs every step).

        Unscheduled ancestors only get fewer as the pass goes on, so a successful search is kept and
        filtered; a failed one is redone only once the node that stopped it (a wait or collective not yet
        placed) is placed, or, after a search that exceeded ``MAX_FEEDERS``, once ``MAX_FEEDERS`` more nodes
        are scheduled.  Each search visits at most ``MAX_FEEDERS + 1`` unscheduled nodes."""
        scheduled = self.scheduled
        if c in self.feeders:
            found = self.feeders[c]
            if found is not None:
                k = 0
                while k < len(found) and scheduled[found[k]]:
                    k += 1
                if k:
                    found = found[k:]
                    self.feeders[c] = found
                return found
            blocker, at = self.feeder_retry[c]
            if blocker >= 0 and not scheduled[blocker]:
                return None
            if blocker < 0 and len(self.order) < at + MAX_FEEDERS:
                return None
        structure = self.structure
        kind = structure.kind
        preds = structure.preds
        stack = [p for p in reversed(preds[c]) if not scheduled[p]]
        seen: set[int] = set()
        out: list[int] = []
        while stack:
            p = stack.pop()
            if p in seen:
                continue
            seen.add(p)
            if kind[p] != COMPUTE:
                self.feeders[c] = None
                self.feeder_retry[c] = (p, 0)
                return None
            out.append(p)
            if len(out) > MAX_FEEDERS:
                self.feeders[c] = None
                self.feeder_retry[c] = (-1, len(self.order))
                return None
            stack.extend(q for q in reversed(preds[p]) if not scheduled[q])
        out.sort()
        self.feeders[c] = out
        return out


    def _stream_and_cap_gate(self, c: int, g: str, t_next: float) -> Optional[str]:
        """Gates (a) and (b) for FSDP collective ``c`` of group ``g`` if the next compute node ends at
        ``t_next``: why issuing it now would not help, or None."""
        structure = self.structure
        in_flight = self.in_flight
        nxt = structure.next_in_group(c)
        queued = nxt >= 0 and not structure.fsdp[nxt] and not structure.fence[nxt] and self.unmet[nxt] == 0
        if not queued and self.clock.stream_free(g) >= t_next:
            return "issuing it earlier would not start it earlier (its stream is busy)"
        if self.max_prefetch is not None and in_flight.count[g] >= self.max_prefetch and not self._make_room(g, blocking=False):
            return f"max_prefetch={self.max_prefetch}: {in_flight.count[g]} collective(s) of group {g!r} in flight"
        return None
    def _hoist(self, c: int, frontier: int, chosen: int) -> str:
        """Hoist the feeders of ``c`` and issue it now, before ``chosen`` runs, if the prefetch gates allow.
        Returns '' when done, '-' when ``c`` has no feeders that could run now, else why not."""
        structure = self.structure
        feeders = self._feeders_of(c)
        if not feeders:
            if feeders is None:
                blocker, at = self.feeder_retry[c]
                self.parked[c] = (blocker, False, at + MAX_FEEDERS)
            return "-"
        if feeders[0] == frontier:
            # it needs the frontier anyway: nothing to hoist until that has run
            self.parked[c] = (frontier, False, 0)
            return "-"
        scheduled = self.scheduled
        feeders = [feeder for feeder in feeders if not scheduled[feeder]]
        self.feeders[c] = feeders
        if chosen in feeders:
            self.parked[c] = (chosen, False, 0)  # it needs the chosen node: an ordinary candidate once that ran
            return "-"
        n_feeders = len(feeders)
        what = f"hoisting its {n_feeders} feeder(s)"
        for v in structure.succs[chosen]:
            if structure.kind[v] == COLLECTIVE and self.unmet[v] == 1:
                # the chosen node is the last input of another collective: hoisting would delay that one
                self.parked[c] = (chosen, False, 0)
                return f"{what} would delay {structure.names[v]}, whose last input {structure.names[chosen]} is about to run"
        if self._delays_non_fsdp(frontier, feeders[-1]):
            return f"{what} would issue a collective that is not FSDP-like later relative to compute"
        durations = self.durations
        busy = 0.0
        for feeder in feeders:
            busy += durations[feeder]
        issue_at = self.clock.now + busy  # when the collective would be issued
        if chosen != frontier:
            gap_end = self._release_time(frontier)
            if issue_at + durations[chosen] > gap_end:
                return f"{what}: would delay {structure.names[frontier]}, which waits on {self._blocker(frontier)}"
        t_next = max(issue_at, self.release[chosen]) + durations[chosen]
        g = structure.group[c]
        why = self._stream_and_cap_gate(c, g, t_next)
        if why:
            return why
        # memory: every feeder's output lives from now on, and so does the collective's
        tree = self.tree
        alloc = self.alloc
        region_lo = structure.region_start[frontier]
        live = self.memory.live
        charged: list[tuple[int, int]] = []
        for feeder in feeders + [c]:
            nbytes = alloc[feeder]
            if not nbytes:
                continue
            why = self._reserve(region_lo, feeder, nbytes, live=live, output_of=structure.names[feeder])
            if why:
                for z, b in charged:
                    tree.add(region_lo, z, -b)  # type: ignore[union-attr]
                return f"{what}: {why}"
            charged.append((feeder, nbytes))
            live += nbytes
        for feeder in feeders:
            self._place(feeder)
            self.why[feeder] = f"hoisted: feeds the prefetch of {structure.names[c]}"
        self.hoisted += n_feeders
        if self.unmet[c] != 0:
            raise InternalError(f"{structure.names[c]} still has unplaced inputs after its feeders were hoisted")
        self._place(c)
        self.why[c] = f"prefetched after hoisting its {n_feeders} feeder(s)"
        return ""

    def _gate(self, c: int, frontier: int, t_next: float) -> str:
        """Why collective ``c`` may not be issued before the chosen node ('' when it may)."""
        structure = self.structure
        for p in structure.preds[c]:
            if not self.scheduled[p]:
                if not self.pending[p]:
                    return "inputs not ready"
                if self.clock.end[structure.coll_of[p]] > self.clock.now:
                    return f"its input {structure.names[p]} waits on an unfinished collective"
        g = structure.group[c]
        if structure.fsdp[c]:
            why = self._stream_and_cap_gate(c, g, t_next)
            if why:
                return why
        return self._reserve(structure.region_start[frontier], c, self.alloc[c], live=self.memory.live)

    def _reserve(self, lo: int, hi: int, nbytes: int, live: Optional[int] = None, output_of: str = "") -> str:
        """The one memory-limit check: ``nbytes`` more are live over original positions ``lo..hi-1`` (and, with
        ``live``, on top of the bytes live now).  Charges them to the headroom tree and returns '' when the
        limit allows, else says why not (``output_of`` names the node whose output it is)."""
        if not nbytes:
            return ""
        limit = self.limit
        if live is not None and live + nbytes > limit:  # type: ignore[operator]
            whose = f"output of {output_of}" if output_of else "output"
            return f"memory limit: {live} B live + {nbytes} B {whose} > {limit} B"
        worst = self.tree.add_within(lo, hi, nbytes, limit)  # type: ignore[union-attr,arg-type]
        if worst + nbytes > limit:  # type: ignore[operator]
            return (f"memory limit: the original order peaks at {worst} B before {output_of or 'it'}, "
                    f"+ {nbytes} B > {limit} B")
        return ""

    def _finish(self) -> None:
        structure = self.structure
        self._issue_due(structure.n)
        self._check_holds(structure.n - 1)
        rest = [i for i in range(structure.n) if not self.scheduled[i]]
        end = self.clock.end
        rest.sort(key=lambda w: (end[structure.coll_of[w]] if structure.kind[w] == WAIT else 0.0, w))
        for w in rest:
            if self.scheduled[w]:
                continue
            if structure.kind[w] != WAIT:
                raise InternalError(f"{structure.names[w]} was left unscheduled")
            self._place_deps(w, "needed by")
            self._place(w)
            if not self.why[w]:
                self.why[w] = "at the end of the graph"

    # -- driver ---------------------------------------------------------------------------------------------
    def run(self) -> ScheduleOutcome:
        structure = self.structure
        n = structure.n
        for i in [i for i in range(n) if not structure.preds[i]]:
            self._available(i)
        computes = structure.computes
        nc = len(computes)
        collectives = structure.collectives
        scheduled = self.scheduled
        clock = self.clock
        finishing = self.finishing
        overdue_heap = self.overdue_heap
        n_collectives = len(collectives)
        blocked, clear = self.blocked, self.clear
        unmet, pending = self.unmet, self.pending
        preds, coll_of, end = structure.preds, structure.coll_of, clock.end
        heappop, heappush = heapq.heappop, heapq.heappush
        pulling = self.tree is not None  # the conservative pass (no tree) neither pulls nor prefetches
        candidates = self.candidates
        fences = structure.fences
        n_fences = len(fences)
        fence_ptr = 0
        # the step parts' own first tests are taken here, and the common cases of choosing and of the chosen
        # node's inputs written out, because most steps have nothing due, nothing finished, nothing overdue and
        # nothing to pull (a call per step and part adds up)
        front_ptr = 0
        while True:
            while front_ptr < nc and scheduled[computes[front_ptr]]:
                front_ptr += 1
            if front_ptr == nc:
                break
            frontier = computes[front_ptr]
            if self.due_ptr < n_collectives and collectives[self.due_ptr] < frontier:
                self._issue_due(frontier)
            if finishing and finishing[0][0] <= clock.now:
                self._release_finished()
            # ``_choose``: the frontier unless there is ready work to pull ahead of it
            now = clock.now
            while blocked and blocked[0][0] <= now:
                i = heappop(blocked)[1]
                if not scheduled[i]:
                    heappush(clear, i)
            while clear and scheduled[clear[0]]:
                heappop(clear)
            if unmet[frontier] != 0:
                raise InternalError(f"frontier node {structure.names[frontier]} has inputs that cannot be scheduled")
            if not clear or clear[0] == frontier or not pulling:
                chosen = frontier
            else:
                chosen = self._pull(frontier)
            # ``_release_time``, noting whether any input is still to place (inputs placed stay placed)
            release = 0.0
            unplaced = False
            for p in preds[chosen]:
                if pending[p]:
                    e = end[coll_of[p]]
                    if e > release:
                        release = e
                if not scheduled[p]:
                    unplaced = True
            if release > clock.now:
                self._release_finished(horizon=release)
            if chosen == frontier and (self.n_overdue or (overdue_heap and overdue_heap[0] < frontier)):
                self._check_holds(frontier)
            if unplaced:
                self._place_deps(chosen, "before its first consumer")
            if pulling:  # prefetch: issue ready collectives and hoist feeders, up to the first fence not issued
                while fence_ptr < n_fences and scheduled[fences[fence_ptr]]:
                    fence_ptr += 1
                fence = fences[fence_ptr] if fence_ptr < n_fences else n
                while True:
                    if candidates:  # on about half the steps there is none
                        self._issue_ready(frontier, chosen, fence)
                    if not self._hoist_one(frontier, chosen, fence):
                        break
            if scheduled[chosen]:
                raise InternalError(f"{structure.names[chosen]} was scheduled twice")
            self._run_compute(chosen)
        self._finish()
        if len(self.order) != n:
            raise InternalError(f"scheduled {len(self.order)} of {n} nodes")
        clock = self.clock
        makespan = clock.finish(c for c in structure.collectives if not structure.waits_of[c])
        # summed per collective in issue order, as ``simulate`` does, so the figures are equal to the last digit
        exposed = sum(clock.exposed.values())
        return ScheduleOutcome(
            self.order, self.memory.peak, exposed, makespan, self.why, self.gate, self.pulled, self.cap_exceeded,
            self.hoisted,
        )
