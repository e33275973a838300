"""The scheduling core: one forward list-scheduling pass over the DAG with simulated time.

State: the compute stream's simulated time ``t``, an ``AsyncTracker`` (per-group stream end, collectives in
flight), a ``MemoryTracker`` (exact live bytes of the order built so far) and a ``HeadroomTree`` (the original
order's memory curve plus the extra live ranges committed to so far, by original position).

The *frontier* ``f`` is the lowest-numbered compute node not yet scheduled.  Every step:

1. due collectives (id < f: the original order issued them before ``f``) are issued now, unconditionally
   (FSDP ones after freeing a ``max_prefetch`` slot if needed);
2. waits whose collective has finished in simulated time and whose running frees memory (or that nothing
   consumes) are placed, without blocking; this is what releases reduce-scatter inputs;
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
   its group is already being consumed), never past a not-yet-issued collective that is not FSDP-like, and
   with the feeders' outputs charged to the memory limit too;
7. the chosen node runs.

Ids are the tie-break everywhere and all containers are heaps or arrays indexed by id, so the result depends
only on the DAG and the durations.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Optional

from .async_tracker import AsyncTracker
from .memory import HeadroomTree, MemoryModel, MemoryTracker
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
        s: Structure,
        mm: MemoryModel,
        base_curve: list[int],
        dur: list[float],
        *,
        limit: Optional[int],
        max_prefetch: Optional[int],
    ):
        n = s.n
        self.s = s
        self.dur = dur
        self.limit = limit
        self.cap = max_prefetch
        self.alloc = mm.alloc
        self.mem = MemoryTracker(mm)
        self.tree = HeadroomTree(base_curve) if limit is not None else None
        self.am = AsyncTracker(s, dur)
        self.t = 0.0
        self.exposed = 0.0
        self.order: list[int] = []
        self.scheduled = bytearray(n)
        self.pending = bytearray(n)  # waits whose inputs are all issued/placed, not placed themselves
        self.unmet = [len(p) for p in s.preds]
        self.release = [0.0] * n  # compute: when its pending waits' collectives end
        self.clear: list[int] = []  # available compute, nothing in flight it needs
        self.blocked: list[tuple[float, int]] = []  # available compute, (release, id)
        self.finishing: list[tuple[float, int]] = []  # pending waits by (collective end, id)
        self.slow: list[tuple[float, int]] = []  # finished pending waits that take compute time
        self.filling = False
        self.overdue_heap: list[int] = []  # pending waits by id
        self.overdue: list[int] = []  # pending waits past their original position
        self.hold_from: dict[int, int] = {}  # wait -> first position its hold is not yet charged on
        self.is_overdue = bytearray(n)
        self.held_by_overdue = [0] * n  # per buffer: how many of its remaining users are overdue waits
        # collectives next in their group with inputs ready: (FSDP-like?, id), so that collectives that are
        # not FSDP-like are issued first and get the memory headroom first
        self.cands: list[tuple[int, int]] = []
        self.in_cands = bytearray(n)
        self.gnext: dict[str, int] = {g: 0 for g in s.seq}
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
        self.due_ptr = 0
        self.fence_ptr = 0
        self.front_ptr = 0

    # -- readiness ------------------------------------------------------------------------------------------
    def _push_cand(self, c: int) -> None:
        if not self.in_cands[c]:
            self.in_cands[c] = 1
            heapq.heappush(self.cands, (self.s.fsdp[c], c))

    def _available(self, i: int) -> None:
        """``i`` has every input placed, issued or pending: file it where the scheduler will look for it."""
        s = self.s
        kind = s.kind
        stack = [i]
        while stack:
            i = stack.pop()
            k = kind[i]
            if k == COMPUTE:
                r = 0.0
                end = self.am.end
                for p in s.preds[i]:
                    if self.pending[p]:
                        e = end[s.coll_of[p]]
                        if e > r:
                            r = e
                self.release[i] = r
                if r <= self.t:
                    heapq.heappush(self.clear, i)
                else:
                    heapq.heappush(self.blocked, (r, i))
            elif k == WAIT:
                self.pending[i] = 1
                heapq.heappush(self.finishing, (self.am.end[s.coll_of[i]], i))
                heapq.heappush(self.overdue_heap, i)
                unmet = self.unmet
                for v in s.succs[i]:
                    unmet[v] -= 1
                    if unmet[v] == 0:
                        stack.append(v)
            else:
                if s.seq_pos[i] == self.gnext[s.group[i]]:
                    self._push_cand(i)

    def _place(self, i: int) -> None:
        if self.scheduled[i]:  # already placed while filling idle time
            return
        s = self.s
        k = s.kind[i]
        if k == COLLECTIVE:
            g = s.group[i]
            if s.seq_pos[i] != self.gnext[g]:
                raise InternalError(f"{s.names[i]} would change the collective order of group {g!r}")
            self.am.issue(i, self.t)
            self.gnext[g] += 1
        elif k == WAIT:
            c = s.coll_of[i]
            e = self.am.end[c]
            if e > self.t and not self.filling and (self.finishing or self.slow):
                # about to block: first run the waits that can use the idle time
                self.filling = True
                try:
                    self._release_finished(horizon=e)
                finally:
                    self.filling = False
                if self.scheduled[i]:
                    return
            if e > self.t:
                self.exposed += e - self.t
                self.t = e
            self.t += self.dur[i]
            self.am.retire(c)
            self.pending[i] = 0
            if self.is_overdue[i]:
                held = self.held_by_overdue
                for r in self.mem.uses[i]:
                    held[r] -= 1
        else:
            self.t += self.dur[i]
        self.mem.run(i)
        self.scheduled[i] = 1
        self.order.append(i)
        if k != WAIT:  # a wait released its consumers when it became pending
            unmet = self.unmet
            for v in s.succs[i]:
                unmet[v] -= 1
                if unmet[v] == 0:
                    self._available(v)
        if k == COLLECTIVE:
            nxt = s.next_in_group(i)
            if nxt >= 0 and self.unmet[nxt] == 0 and not self.scheduled[nxt]:
                self._push_cand(nxt)

    def _place_deps(self, x: int, why: str) -> None:
        """Place the pending waits ``x`` still needs (and theirs), in id order."""
        s = self.s
        scheduled = self.scheduled
        stack = [p for p in s.preds[x] if not scheduled[p]]
        if not stack:
            return
        todo: list[int] = []
        seen: set[int] = set()
        while stack:
            p = stack.pop()
            if p in seen or scheduled[p]:
                continue
            seen.add(p)
            if not self.pending[p]:
                raise InternalError(f"{s.names[x]} needs {s.names[p]}, which cannot run yet")
            todo.append(p)
            stack.extend(q for q in s.preds[p] if not scheduled[q])
        todo.sort()
        for p in todo:
            self._place(p)
            if not self.why[p]:
                self.why[p] = why

    # -- step parts -------------------------------------------------------------------------------------------
    def _make_room(self, g: str, blocking: bool) -> bool:
        """Bring group ``g`` below ``max_prefetch`` in flight by placing its oldest collectives' waits.

        Non-blocking: only waits whose collective has already finished in simulated time."""
        am = self.am
        cap = self.cap
        while am.count[g] >= cap:
            o = am.oldest(g)
            if o < 0:
                break
            ws = [w for w in self.s.waits_of[o] if not self.scheduled[w]]
            if not ws or not all(self.pending[w] for w in ws):
                return False
            if not blocking and am.end[o] > self.t:
                return False
            for w in ws:
                self._place_deps(w, f"needed by {self.s.names[w]}")
                self._place(w)
                if not self.why[w]:
                    self.why[w] = f"early: frees a max_prefetch={cap} slot of group {g!r}"
        return am.count[g] < cap

    def _check_holds(self, upto: int) -> None:
        """Pending waits whose original position is before ``upto`` (overdue) keep buffers alive that the
        original order had freed by then: the buffers whose remaining users are all overdue waits.  Charge
        that memory up to ``upto``, or place the wait now if the limit says no."""
        oh = self.overdue_heap
        scheduled = self.scheduled
        uses = self.mem.uses
        held = self.held_by_overdue
        while oh and oh[0] < upto:
            w = heapq.heappop(oh)
            if not scheduled[w]:
                self.overdue.append(w)
                self.is_overdue[w] = 1
                for r in uses[w]:
                    held[r] += 1
        if not self.overdue:
            return
        keep: list[int] = []
        tree = self.tree
        limit = self.limit
        remaining = self.mem.remaining
        alloc = self.alloc
        hi = upto + 1
        charged: set[int] = set()  # buffers already charged in this call (held by several waits)
        for w in self.overdue:
            if scheduled[w]:
                continue
            lo = self.hold_from.get(w, w + 1)
            if lo >= hi:
                keep.append(w)
                continue
            mine = [r for r in uses[w] if remaining[r] == held[r] and r not in charged]
            h = 0
            for r in mine:
                h += alloc[r]
            if h == 0:
                self.hold_from[w] = hi
                keep.append(w)
                continue
            if tree is not None and tree.max(lo, hi) + h <= limit:  # type: ignore[operator]
                tree.add(lo, hi, h)
                self.hold_from[w] = hi
                charged.update(mine)
                keep.append(w)
                continue
            self._place_deps(w, f"needed by {self.s.names[w]}")
            self._place(w)
            if not self.why[w]:
                self.why[w] = f"early: keeping {h} B of inputs alive longer would exceed the memory limit"
        self.overdue = keep

    def _issue_due(self, f: int) -> None:
        s = self.s
        cols = s.collectives
        while self.due_ptr < len(cols) and cols[self.due_ptr] < f:
            c = cols[self.due_ptr]
            self.due_ptr += 1
            if self.scheduled[c]:
                continue
            self._check_holds(c)
            self._place_deps(c, f"needed by collective {s.names[c]}")
            if self.cap is not None and s.fsdp[c]:
                if not self._make_room(s.group[c], blocking=True):
                    self.cap_exceeded += 1
            self._place(c)
            self.why[c] = "at its original place"

    def _release_finished(self, horizon: Optional[float] = None) -> None:
        """Place pending waits that free memory or that nothing consumes, once their collective has finished.

        A wait that takes compute time of its own is compute work: it is only run early in time the compute
        stream would spend blocked anyway.  With ``horizon`` (the stream is about to block until then), waits
        finishing by ``horizon`` are placed first, if their own duration fits before it."""
        fh = self.finishing
        slow = self.slow
        dur = self.dur
        scheduled = self.scheduled
        if horizon is not None:
            # first the waits that take time, while the stream is still free to run them before ``horizon``
            late: list[tuple[float, int]] = []
            while slow and slow[0][0] <= horizon and len(late) < PULL_TRIES:
                e, w = heapq.heappop(slow)
                if scheduled[w]:
                    continue
                if max(self.t, e) + dur[w] > horizon:
                    late.append((e, w))
                    continue
                self._release(w, idle=True)
            for item in late:
                heapq.heappush(slow, item)
        limit = self.t if horizon is None else horizon
        while fh and fh[0][0] <= limit:
            e, w = heapq.heappop(fh)
            if scheduled[w]:
                continue
            if dur[w] > 0.0:
                if horizon is not None and max(self.t, e) + dur[w] <= horizon:
                    self._release(w, idle=True)
                else:
                    heapq.heappush(slow, (e, w))
                continue
            self._release(w)

    def _release(self, w: int, idle: bool = False) -> None:
        """Place finished wait ``w`` if that frees memory, if nothing consumes it, or (``idle``) if its own
        duration runs in time the compute stream would otherwise spend blocked."""
        freed = self.mem.frees_if_run(w)
        if freed > 0 or idle or not self.s.succs[w]:
            self._place_deps(w, f"needed by {self.s.names[w]}")
            self._place(w)
            if not self.why[w]:
                if freed:
                    self.why[w] = f"when its collective finished: frees {freed} B"
                elif idle:
                    self.why[w] = "when its collective finished: runs while the compute stream would block"
                else:
                    self.why[w] = "when its collective finished: nothing consumes it"

    def _choose(self, f: int) -> int:
        blocked, clear, scheduled = self.blocked, self.clear, self.scheduled
        t = self.t
        while blocked and blocked[0][0] <= t:
            _, i = heapq.heappop(blocked)
            if not scheduled[i]:
                heapq.heappush(clear, i)
        while clear and scheduled[clear[0]]:
            heapq.heappop(clear)
        if self.unmet[f] != 0:
            raise InternalError(f"frontier node {self.s.names[f]} has inputs that cannot be scheduled")
        if not clear or clear[0] == f or self.tree is None:
            return f
        # the frontier waits on a collective still in flight: fill the gap with ready work that ends before
        # the frontier could start anyway (so the frontier is never delayed), if memory allows
        s = self.s
        lo = s.region_start[f]
        limit = self.limit
        gap_end = self._release_time(f)
        rejected: list[int] = []
        chosen = f
        for _ in range(PULL_TRIES):
            if not clear:
                break
            x = heapq.heappop(clear)
            if scheduled[x]:
                continue
            a = self.alloc[x]
            if t + self.dur[x] > gap_end or self._delays_non_fsdp(f, x):
                rejected.append(x)
                continue
            if a == 0 or (self.mem.live + a <= limit and self.tree.max(lo, x) + a <= limit):  # type: ignore
                self.tree.add(lo, x, a)
                chosen = x
                self.pulled += 1
                self.why[x] = f"pulled ahead of {s.names[f]}, which waits on {self._blocker(f)}"
                break
            rejected.append(x)
        for x in rejected:
            heapq.heappush(clear, x)
        return chosen

    def _delays_non_fsdp(self, f: int, x: int) -> bool:
        """Would running compute node ``x`` now put it before a not-yet-issued collective that is not
        FSDP-like (TP, EP, barrier-like) and came before ``x`` originally?  Such collectives keep their
        position relative to compute: pulling ``x`` ahead of them would issue them one compute node later."""
        ids = self.s.non_fsdp_collectives
        if not ids:
            return False
        scheduled = self.scheduled
        for k in range(bisect.bisect_right(ids, f), bisect.bisect_left(ids, x)):
            if not scheduled[ids[k]]:
                return True
        return False

    def _release_time(self, x: int) -> float:
        """When the collectives behind ``x``'s pending waits end (0 when none)."""
        s = self.s
        r = 0.0
        for p in s.preds[x]:
            if self.pending[p]:
                e = self.am.end[s.coll_of[p]]
                if e > r:
                    r = e
        return r

    def _blocker(self, f: int) -> str:
        s = self.s
        best, best_end = -1, -1.0
        for p in s.preds[f]:
            if self.pending[p] and self.am.end[s.coll_of[p]] > best_end:
                best, best_end = s.coll_of[p], self.am.end[s.coll_of[p]]
        return s.names[best] if best >= 0 else "a collective"

    def _prefetch(self, f: int, x: int) -> None:
        if self.tree is None:
            return
        s = self.s
        scheduled = self.scheduled
        fences = s.fences
        while self.fence_ptr < len(fences) and scheduled[fences[self.fence_ptr]]:
            self.fence_ptr += 1
        fence = fences[self.fence_ptr] if self.fence_ptr < len(fences) else s.n
        while True:
            self._issue_ready(f, x, fence)
            if not self._hoist_one(f, x, fence):
                break

    def _issue_ready(self, f: int, x: int, fence: int) -> None:
        """Issue the candidates (next in their group, inputs ready) that the gates let through."""
        s = self.s
        scheduled = self.scheduled
        t_next = max(self.t, self.release[x]) + self.dur[x]
        cands = self.cands
        retry: list[int] = []
        while cands:
            _, c = heapq.heappop(cands)
            self.in_cands[c] = 0
            if scheduled[c] or s.seq_pos[c] != self.gnext[s.group[c]]:
                continue
            if s.fence[c]:
                why = "barrier-like collective: kept at its original place"
            elif c > fence:
                why = f"not moved across barrier-like collective {s.names[fence]}"
            else:
                why = self._gate(c, f, t_next)
            if why:
                self.gate[c] = why
                retry.append(c)
                continue
            self._place_deps(c, f"needed by collective {s.names[c]}")
            self._place(c)
            self.why[c] = "prefetched" if s.fsdp[c] else "not FSDP-like: issued as soon as its inputs were ready"
        for c in retry:
            self._push_cand(c)

    # -- hoisting the feeders of a prefetch -----------------------------------------------------------------
    def _hoist_one(self, f: int, x: int, fence: int) -> bool:
        """Try, in id order, each group's next collective that is FSDP-like and waits only on compute that
        could run now (its *feeders*); hoist the feeders and issue it for the first one the gates allow."""
        s = self.s
        heads = []
        for g, seq in s.seq.items():
            k = self.gnext[g]
            if k < len(seq):
                c = seq[k]
                if self.unmet[c] and s.fsdp[c] and not s.fence[c] and c <= fence:
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
                    if not scheduled[node] and not (at_x and node == x):
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
                if found and found[0] == f:
                    parked[c] = (f, False, 0)
                    continue
            u = self._beyond_horizon(c, x)
            if u >= 0:
                parked[c] = (u, True, 0)  # the normal state of a collective more than one ahead: no gate
                continue
            why = self._hoist(c, f, x)
            if not why:
                return True
            if why != "-":
                self.gate[c] = why
        return False

    def _beyond_horizon(self, c: int, x: int) -> int:
        """Hoisting moves compute, so it looks one collective ahead only: the feeders of ``c`` may be hoisted
        once the compute has started consuming the previous collective of the same op in its group (its
        first consumer has run or is ``x``, about to run), i.e. during the block before ``c``'s.  Collectives
        nobody consumes (gradient reductions whose result is a graph output) are skipped when looking back
        (at most ``HORIZON_LOOKBACK`` of them).  Returns the consumer still to come, or -1 when ``c`` is
        within the horizon."""
        s = self.s
        seq = s.seq[s.group[c]]
        op = s.coll_op[c]
        k = s.seq_pos[c] - 1
        stop = max(-1, k - HORIZON_LOOKBACK)
        while k > stop:
            p = seq[k]
            k -= 1
            if s.coll_op[p] is not op:
                continue
            u = s.first_use[p]
            if u < 0:
                continue
            return -1 if self.scheduled[u] or u == x else u
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
        s = self.s
        kind = s.kind
        preds = s.preds
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
        s = self.s
        am = self.am
        nxt = s.next_in_group(c)
        queued = nxt >= 0 and not s.fsdp[nxt] and not s.fence[nxt] and self.unmet[nxt] == 0
        if not queued and am.stream_free(g) >= t_next:
            return "issuing it earlier would not start it earlier (its stream is busy)"
        if self.cap is not None and am.count[g] >= self.cap and not self._make_room(g, blocking=False):
            return f"max_prefetch={self.cap}: {am.count[g]} collective(s) of group {g!r} in flight"
        return None
    def _hoist(self, c: int, f: int, x: int) -> str:
        """Hoist the feeders of ``c`` and issue it now, before ``x`` runs, if the prefetch gates allow.
        Returns '' when done, '-' when ``c`` has no feeders that could run now, else why not."""
        s = self.s
        fs = self._feeders_of(c)
        if not fs:
            if fs is None:
                blocker, at = self.feeder_retry[c]
                self.parked[c] = (blocker, False, at + MAX_FEEDERS)
            return "-"
        if fs[0] == f:
            # it needs the frontier anyway: nothing to hoist until that has run
            self.parked[c] = (f, False, 0)
            return "-"
        scheduled = self.scheduled
        fs = [y for y in fs if not scheduled[y]]
        self.feeders[c] = fs
        if x in fs:
            self.parked[c] = (x, False, 0)  # it needs the chosen node: an ordinary candidate once that ran
            return "-"
        n_f = len(fs)
        what = f"hoisting its {n_f} feeder(s)"
        for v in s.succs[x]:
            if s.kind[v] == COLLECTIVE and self.unmet[v] == 1:
                # the chosen node is the last input of another collective: hoisting would delay that one
                self.parked[c] = (x, False, 0)
                return f"{what} would delay {s.names[v]}, whose last input {s.names[x]} is about to run"
        if self._delays_non_fsdp(f, fs[-1]):
            return f"{what} would issue a collective that is not FSDP-like later relative to compute"
        dur = self.dur
        busy = 0.0
        for y in fs:
            busy += dur[y]
        t1 = self.t + busy  # when the collective would be issued
        if x != f:
            gap_end = self._release_time(f)
            if t1 + dur[x] > gap_end:
                return f"{what}: would delay {s.names[f]}, which waits on {self._blocker(f)}"
        t_next = max(t1, self.release[x]) + dur[x]
        g = s.group[c]
        why = self._stream_and_cap_gate(c, g, t_next)
        if why:
            return why
        # memory: every feeder's output lives from now on, and so does the collective's
        tree = self.tree
        limit = self.limit
        alloc = self.alloc
        lo = s.region_start[f]
        live = self.mem.live
        charged: list[tuple[int, int]] = []
        for y in fs + [c]:
            a = alloc[y]
            if not a:
                continue
            why = ""
            if live + a > limit:  # type: ignore[operator]
                why = f"memory limit: {live} B live + {a} B output of {s.names[y]} > {limit} B"
            else:
                worst = tree.max(lo, y)  # type: ignore[union-attr]
                if worst + a > limit:  # type: ignore[operator]
                    why = (f"memory limit: the original order peaks at {worst} B before {s.names[y]}, "
                           f"+ {a} B > {limit} B")
            if why:
                for z, b in charged:
                    tree.add(lo, z, -b)  # type: ignore[union-attr]
                return f"{what}: {why}"
            tree.add(lo, y, a)  # type: ignore[union-attr]
            charged.append((y, a))
            live += a
        for y in fs:
            self._place(y)
            self.why[y] = f"hoisted: feeds the prefetch of {s.names[c]}"
        self.hoisted += n_f
        if self.unmet[c] != 0:
            raise InternalError(f"{s.names[c]} still has unplaced inputs after its feeders were hoisted")
        self._place(c)
        self.why[c] = f"prefetched after hoisting its {n_f} feeder(s)"
        return ""

    def _gate(self, c: int, f: int, t_next: float) -> str:
        """Why collective ``c`` may not be issued before the chosen node ('' when it may)."""
        s = self.s
        am = self.am
        for p in s.preds[c]:
            if not self.scheduled[p]:
                if not self.pending[p]:
                    return "inputs not ready"
                if am.end[s.coll_of[p]] > self.t:
                    return f"its input {s.names[p]} waits on an unfinished collective"
        g = s.group[c]
        if s.fsdp[c]:
            why = self._stream_and_cap_gate(c, g, t_next)
            if why:
                return why
        a = self.alloc[c]
        if a:
            limit = self.limit
            lo = s.region_start[f]
            if self.mem.live + a > limit:  # type: ignore[operator]
                return f"memory limit: {self.mem.live} B live + {a} B output > {limit} B"
            worst = self.tree.max(lo, c)  # type: ignore[union-attr]
            if worst + a > limit:  # type: ignore[operator]
                return f"memory limit: the original order peaks at {worst} B before it, + {a} B > {limit} B"
            self.tree.add(lo, c, a)  # type: ignore[union-attr]
        return ""

    def _finish(self) -> None:
        s = self.s
        self._issue_due(s.n)
        self._check_holds(s.n - 1)
        rest = [i for i in range(s.n) if not self.scheduled[i]]
        end = self.am.end
        rest.sort(key=lambda w: (end[s.coll_of[w]] if s.kind[w] == WAIT else 0.0, w))
        for w in rest:
            if self.scheduled[w]:
                continue
            if s.kind[w] != WAIT:
                raise InternalError(f"{s.names[w]} was left unscheduled")
            self._place_deps(w, f"needed by {s.names[w]}")
            self._place(w)
            if not self.why[w]:
                self.why[w] = "at the end of the graph"

    # -- driver ---------------------------------------------------------------------------------------------
    def run(self) -> ScheduleOutcome:
        s = self.s
        n = s.n
        for i in [i for i in range(n) if not s.preds[i]]:
            self._available(i)
        computes = s.computes
        nc = len(computes)
        scheduled = self.scheduled
        while True:
            while self.front_ptr < nc and scheduled[computes[self.front_ptr]]:
                self.front_ptr += 1
            if self.front_ptr == nc:
                break
            f = computes[self.front_ptr]
            self._issue_due(f)
            self._release_finished()
            x = self._choose(f)
            r = self._release_time(x)
            if r > self.t:
                self._release_finished(horizon=r)
            if x == f:
                self._check_holds(f)
            self._place_deps(x, f"before its first consumer {s.names[x]}")
            self._prefetch(f, x)
            if scheduled[x]:
                raise InternalError(f"{s.names[x]} was scheduled twice")
            self._place(x)
        self._finish()
        if len(self.order) != n:
            raise InternalError(f"scheduled {len(self.order)} of {n} nodes")
        compute_end = self.t
        exposed = self.exposed
        for c in s.collectives:
            if not s.waits_of[c] and self.am.end[c] > compute_end:
                exposed += self.am.end[c] - compute_end
        makespan = max([compute_end, *self.am.stream_end.values()])
        return ScheduleOutcome(
            self.order, self.mem.peak, exposed, makespan, self.why, self.gate, self.pulled, self.cap_exceeded,
            self.hoisted,
        )
