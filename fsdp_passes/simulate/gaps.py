"""Where a simulated schedule's time goes above its lower bounds.

A ``Timeline`` of ``simulate`` splits exactly into

    makespan = compute + issue + slowdown + exposed

- compute: the durations of every node that is not a collective (bucket copies among them: the
  ``fsdp_passes::*`` copy kernels into and out of buckets);
- issue: the host issue time of the collectives (``OverlapCosts.issue_ms`` each);
- slowdown: what compute lost running beside collectives (``OverlapCosts.compute_slowdown``);
- exposed: time the compute stream waited on a collective, plus the time collectives ran past its end.

The exposed time is split by collective: each group's first one (in the forward, the first gather: nothing
but its own feeders can run before it), each group's last one (the last reduce-scatter, and whatever runs
past the compute stream), and the ones in between, which an order could in principle hide.  Those are split
by why they were not issued earlier in this order:

- queued: it started after its issue because its group's stream was still busy (a stream running back to
  back: issuing it earlier would not start it earlier);
- dependency: it was issued right after its last input (or its group's previous collective);
- memory: issuing it right after that point would have lifted the live bytes over ``memory_limit`` somewhere
  before its actual issue (the memory budget stopped the prefetch);
- order: neither, the order could have issued it earlier.

``overlap_lower_bound`` is what no order can avoid; ``GapParts.over_bound_ms`` is the makespan above it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ..dag.graph import Dag, NodeKind
from ..dag.ops import op_base_name
from .bounds import overlap_lower_bound
from .memory import wait_collectives
from .timeline import OverlapCosts, Timeline, check_durations, group_key

#: the namespace of the copy kernels bucketing adds (``bucketing.rewrite``: copy_in_members, copy_out_members,
#: bucket_cat, copy_into_slot and their ``_into`` forms)
BUCKET_COPY_NAMESPACE = "fsdp_passes"


@dataclass(frozen=True)
class GapParts:
    """The parts of one simulated schedule's makespan (ms); see the module docstring.

    compute_ms + issue_ms + slowdown_ms + first_exposed_ms + last_exposed_ms + middle_exposed_ms = makespan_ms,
    and middle_exposed_ms = queued_ms + dependency_ms + memory_ms + order_ms.  bucket_copy_ms is part of
    compute_ms.  slowdown_floor_ms is the least slowdown an order with this schedule's exposed time must pay:
    the busiest group's comm time not spent exposed or issuing, times s / (1 + s).
    """

    makespan_ms: float
    lower_bound_ms: float
    overlap_bound_ms: float
    compute_ms: float
    bucket_copy_ms: float
    issue_ms: float
    slowdown_ms: float
    slowdown_floor_ms: float
    first_exposed_ms: float
    last_exposed_ms: float
    middle_exposed_ms: float
    queued_ms: float
    dependency_ms: float
    memory_ms: float
    order_ms: float

    @property
    def over_bound_ms(self) -> float:
        return self.makespan_ms - self.overlap_bound_ms

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "over_bound_ms": self.over_bound_ms}


def gap_parts(dag: Dag, timeline: Timeline, durations: Sequence[float], overlap: OverlapCosts | None = None,
              memory_limit: int | None = None) -> GapParts:
    """Split ``timeline`` (``simulate(dag, order, durations, overlap)``) into ``GapParts``.

    ``memory_limit``: the live bytes the order had to stay under (None: no limit, no exposed time is
    called memory-limited).
    """
    dur = check_durations(dag, durations)
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, int)
                                     or memory_limit < 0):
        raise ValueError(f"memory_limit={memory_limit!r} is not valid: expected a non-negative int (bytes) or None")
    if len(timeline.order) != len(dag.nodes):
        raise ValueError(f"timeline.order has {len(timeline.order)} nodes, the dag {len(dag.nodes)}")
    nodes = dag.nodes
    collective = NodeKind.COLLECTIVE
    colls = [i for i, node in enumerate(nodes) if node.kind is collective]
    compute = sum(d for i, d in enumerate(dur) if nodes[i].kind is not collective)
    copies = sum(d for i, d in enumerate(dur)
                 if nodes[i].kind is not collective and op_base_name(nodes[i].op)[0] == BUCKET_COPY_NAMESPACE)
    issue = (overlap.issue_ms if overlap is not None else 0.0) * len(colls)
    slowdown = timeline.compute_busy - compute - issue

    blocked = {c: 0.0 for c in colls}
    for w, c in enumerate(wait_collectives(dag)):
        if c >= 0:
            blocked[c] += timeline.wait_blocked.get(w, 0.0)
    past_end = timeline.makespan - timeline.compute_end  # collectives running past the compute stream

    position = {node: p for p, node in enumerate(timeline.order)}
    by_group: dict[str, list[int]] = {}
    for c in sorted(colls, key=position.__getitem__):
        by_group.setdefault(group_key(nodes[c].group_name), []).append(c)
    first = {seq[0] for seq in by_group.values()}
    last = {seq[-1] for seq in by_group.values()} - first
    previous = {seq[k]: seq[k - 1] for seq in by_group.values() for k in range(1, len(seq))}

    parts = dict(first=0.0, last=past_end, queued=0.0, dependency=0.0, memory=0.0, order=0.0)
    issue_each = overlap.issue_ms if overlap is not None else 0.0
    for c in colls:
        b = blocked[c]
        if b <= 0.0:
            continue
        if c in first:
            parts["first"] += b
        elif c in last:
            parts["last"] += b
        else:
            parts[_why_late(dag, timeline, c, position, previous.get(c), issue_each, memory_limit)] += b

    exposed = timeline.makespan - timeline.compute_busy
    busiest = max((sum(dur[c] for c in seq) for seq in by_group.values()), default=0.0)
    s = overlap.compute_slowdown if overlap is not None else 0.0
    floor = max(0.0, busiest - exposed - issue) * s / (1.0 + s)
    middle = parts["queued"] + parts["dependency"] + parts["memory"] + parts["order"]
    return GapParts(
        makespan_ms=timeline.makespan, lower_bound_ms=timeline.lower_bound,
        overlap_bound_ms=overlap_lower_bound(dag, dur, overlap), compute_ms=compute, bucket_copy_ms=copies,
        issue_ms=issue, slowdown_ms=slowdown, slowdown_floor_ms=floor, first_exposed_ms=parts["first"],
        last_exposed_ms=parts["last"], middle_exposed_ms=middle, queued_ms=parts["queued"],
        dependency_ms=parts["dependency"], memory_ms=parts["memory"], order_ms=parts["order"])


def _why_late(dag: Dag, timeline: Timeline, c: int, position: dict[int, int], previous: int | None,
              issue_ms: float, memory_limit: int | None) -> str:
    """Why exposed collective ``c`` (not its group's first or last) was not issued earlier in this order."""
    if timeline.start[c] > timeline.issue[c] + issue_ms:
        return "queued"
    after = [position[p] for p in dag.preds[c]]
    if previous is not None:
        after.append(position[previous])
    earliest = max(after, default=-1) + 1
    here = position[c]
    if earliest >= here:
        return "dependency"
    if memory_limit is not None:
        # its output would have been live from ``earliest`` on (the curve holds it from ``here``)
        held = max(timeline.memory[earliest:here]) + dag.nodes[c].out_bytes
        if held > memory_limit:
            return "memory"
    return "order"
