"""What a bucketing planner produces: buckets of DAG collectives, and why the others stay alone.

A plan is pure data over DAG node ids; ``bucketing.rewrite`` applies it to the FX graph.  Helpers shared by
the planners live here too: which collectives may be bucketed at all (``bucketability``), the key that
members of one bucket must share (``bucket_key``), a bucket grown one member at a time under the planners'
bounds (``GrowingBucket``), splitting a member list where one member depends on another (``split_dependent``)
and the whole-plan cycle check (``plan_cycles``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from ..dag.collectives import KINDS
from ..dag.graph import CollectiveOp, Dag, DagNode, NodeKind

#: Collective kinds the rewrite knows how to merge.
BUCKETABLE_OPS = tuple(op for op, kind in KINDS.items() if kind.bucketable)

#: Why a bucket stopped growing.
CLOSE_REASONS = (
    "plan",        # a manual plan entry ended here
    "size_cap",    # the next member would exceed bucket_cap_mb
    "memory",      # the bucket would exceed its share of the memory budget (rank-invariant bound)
    "latency",     # merging the next member would not be cheaper than two collectives
    "dependency",  # the next member depends on a member's result
    "dtype",       # a manual plan entry holds several dtypes: one bucket per dtype
    "cycle",       # split because buckets together would form a dependency cycle
    "end",         # no more collectives of this kind
)


@dataclass
class Bucket:
    """Collectives merged into one.

    ``members`` are DAG node ids of collectives in original graph order; all share ``op``, ``group_name``,
    ``reduce_op`` and ``dtype``.  ``comm_bytes`` is the merged payload (NCCL convention, see ``DagNode``).
    ``label`` names what formed it (a plan entry, or the auto planner's key).
    """

    members: list[int]
    op: CollectiveOp
    group_name: str
    reduce_op: str | None
    dtype: str | None
    comm_bytes: int
    close_reason: str = "end"
    label: str = ""
    member_names: list[str] = field(default_factory=list)
    params: list[str | None] = field(default_factory=list)
    extra_bytes: int = 0  # bound on the memory held longer because of the merge (``extra_bytes_bound``)
    kept_bytes: int = 0  # gathered members that are graph outputs: their copies may be kept to the end

    def __len__(self) -> int:
        return len(self.members)

    def to_json(self) -> dict[str, Any]:
        return {
            "members": list(self.member_names) or list(self.members),
            "op": self.op.value,
            "group": self.group_name,
            "reduce_op": self.reduce_op,
            "dtype": self.dtype,
            "comm_bytes": self.comm_bytes,
            "close_reason": self.close_reason,
            "label": self.label,
            "params": list(self.params),
            "extra_bytes": self.extra_bytes,
            "kept_bytes": self.kept_bytes,
        }


@dataclass
class BucketPlanResult:
    """A plan: buckets (each with at least one member), the collectives left alone with the reason why."""

    buckets: list[Bucket]
    unbucketed: dict[int, str]
    n_collectives_before: int
    unmatched_entries: list[str] = field(default_factory=list)  # manual plans: entries that matched nothing
    fqns_seen: list[str] = field(default_factory=list)  # manual plans with unmatched entries: the graph's FQNs

    @property
    def n_collectives_after(self) -> int:
        return self.n_collectives_before - sum(len(b) - 1 for b in self.buckets if len(b) > 1)

    @property
    def stats(self) -> dict[str, int]:
        return {
            "n_collectives_before": self.n_collectives_before,
            "n_collectives_after": self.n_collectives_after,
            "n_buckets": sum(1 for b in self.buckets if len(b) > 1),
        }


# -- what may be bucketed ------------------------------------------------------------------------------------

BucketKey = tuple[str, str, Optional[str], Optional[str], Optional[int]]


def bucket_key(node: DagNode) -> BucketKey:
    """Members of one bucket share process group, op, reduce op, dtype and group size."""
    # ``_value_`` is what the ``value`` property returns, read without the property's call (this runs per
    # collective and per candidate member)
    op = node.collective._value_ if node.collective is not None else "?"
    return (op, node.group_name or "?", node.reduce_op, node.dtype, node.group_size)


def bucketability(dag: Dag, i: int, *, bucket_non_fsdp: bool = False) -> str | None:
    """None if collective ``i`` may join a bucket, else the reason it may not."""
    node = dag.nodes[i]
    if node.kind is not NodeKind.COLLECTIVE:
        return "not a collective"
    if node.collective not in BUCKETABLE_OPS:
        return f"{node.collective.value if node.collective else 'unknown'} collectives are not bucketed"
    if not node.fsdp and not bucket_non_fsdp:
        return "not an FSDP parameter gather / gradient reduction (set bucket_non_fsdp=True to include it)"
    if "group_size" in KINDS[node.collective].args and (not node.group_size or node.group_size < 1):
        return "unknown process-group size"  # all-gather / reduce-scatter carry it in their arguments
    nodes = dag.nodes
    wait = NodeKind.WAIT
    n_waits = 0
    for s in dag.succs[i]:  # counted, not listed: this runs once per collective
        if nodes[s].kind is wait:
            n_waits += 1
    if n_waits != 1:
        return f"has {n_waits} waits, expected exactly one"
    origin = node.origin
    if origin is not None and hasattr(origin, "users"):
        err = _fx_bucketability(origin, node)
        if err:
            return err
    return None


@dataclass(frozen=True, eq=False)
class CollectiveSurvey:
    """The collectives of ``dag``, each judged once (``bucketability``) and keyed (``bucket_key``) for the
    planners that read them: ``plan_bucketing`` needs them for the budget's block claim and again for the
    plan, and judging is a good part of planning a large graph.  Take one with ``survey_collectives``; it
    holds for the DAG as it was then (planning does not change a DAG)."""

    dag: Dag = field(repr=False)
    bucket_non_fsdp: bool
    collectives: list[int]  # every collective, graph order
    unbucketed: dict[int, str]  # collective -> why it may not join a bucket, graph order
    keys: dict[int, BucketKey]  # the others -> their ``bucket_key``, graph order


def survey_collectives(dag: Dag, *, bucket_non_fsdp: bool = False) -> CollectiveSurvey:
    """The ``CollectiveSurvey`` of ``dag``."""
    unbucketed: dict[int, str] = {}
    keys: dict[int, BucketKey] = {}
    collectives = dag.collectives()
    nodes = dag.nodes
    for c in collectives:
        why = bucketability(dag, c, bucket_non_fsdp=bucket_non_fsdp)
        if why:
            unbucketed[c] = why
        else:
            keys[c] = bucket_key(nodes[c])
    return CollectiveSurvey(dag, bucket_non_fsdp, collectives, unbucketed, keys)


def surveyed(dag: Dag, bucket_non_fsdp: bool, survey: CollectiveSurvey | None) -> CollectiveSurvey:
    """``survey`` when given (checked to be of ``dag`` and ``bucket_non_fsdp``), else a new one."""
    if survey is None:
        return survey_collectives(dag, bucket_non_fsdp=bucket_non_fsdp)
    if survey.dag is not dag or survey.bucket_non_fsdp != bucket_non_fsdp:
        raise ValueError("survey: taken of another DAG or with another bucket_non_fsdp; take it with "
                         "survey_collectives(dag, bucket_non_fsdp=...) of the DAG being planned")
    return survey


def _fx_bucketability(fx_node: Any, node: DagNode) -> str | None:
    import torch

    from ..dag.from_fx import op_name

    kind = KINDS[node.collective]
    if op_name(fx_node) != kind.bucket_op:
        return f"op {op_name(fx_node)} is not the functional {kind.bucket_op}"
    users = list(fx_node.users)
    if len(users) != 1 or "wait_tensor" not in op_name(users[0]):
        return "its result is used by something other than one wait_tensor"
    if not fx_node.args or not hasattr(fx_node.args[0], "meta"):
        return "its input is not a graph node"
    val = fx_node.args[0].meta.get("val")
    out = fx_node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor):
        return "no tensor metadata (meta['val']) on its input or output"
    if any(not isinstance(s, int) for s in tuple(val.shape) + tuple(out.shape)):
        return "symbolic shape"
    if val.dtype != out.dtype:
        return "input and output dtypes differ"
    if kind.scatters and (val.dim() == 0 or val.shape[0] % node.group_size):
        return f"input dim 0 is not divisible by the group size {node.group_size}"
    if kind.gathers and val.dim() == 0:
        return "0-d input"
    return None


# -- dependencies --------------------------------------------------------------------------------------------

def split_dependent(dag: Dag, members: Sequence[int]) -> list[list[int]]:
    """Split ``members`` (ascending ids) into runs where no member depends on an earlier one of its run.

    Forward taint propagation over the id window of each run (ids are a topological order): O(window + its
    edges) per run.
    """
    runs: list[list[int]] = []
    if not members:
        return runs
    run = GrowingBucket(dag, members[0])
    for m in members[1:]:
        if run.depends_on_member(m):
            runs.append(run.members)
            run.restart(m)
        else:
            run.add(m)
    runs.append(run.members)
    return runs


class GrowingBucket:
    """A bucket grown one collective at a time along a run of one bucket key (ascending ids), as the planners
    grow theirs: its members, their payload summed and smallest (all its ``extra_bytes_bound`` needs, kept as
    it grows: linear, where re-summing per member was quadratic in its length), and the forward taint of its
    id window (which nodes depend on a member's result: each id of the window is scanned once per bucket, ids
    being a topological order)."""

    __slots__ = ("nodes", "preds", "op", "group_size", "members", "total", "smallest", "tainted", "scanned")

    def __init__(self, dag: Dag, first: int):
        self.nodes, self.preds = dag.nodes, dag.preds
        node = dag.nodes[first]
        self.op = node.collective
        self.group_size = node.group_size or 2  # an all-reduce's group may be unknown here: priced as 2 ranks
        self.restart(first)

    def restart(self, first: int) -> None:
        """A new bucket holding ``first`` alone."""
        self.members = [first]
        self.total = self.smallest = self.nodes[first].comm_bytes
        self.tainted = {first}
        self.scanned = first

    def depends_on_member(self, j: int) -> bool:
        """Whether collective ``j`` (after every member) reads a member's result, directly or not."""
        tainted, preds = self.tainted, self.preds
        for v in range(self.scanned + 1, j):  # v is not tainted yet: the window is scanned once
            if not tainted.isdisjoint(preds[v]):
                tainted.add(v)
        self.scanned = j
        return not tainted.isdisjoint(preds[j])

    def over_bound(self, j: int, cap_bytes: int | None, limit: int | None) -> str | None:
        """Why adding ``j`` would break a bound: "size_cap" (merged payload above ``cap_bytes``), "memory"
        (``extra_bytes_bound`` above ``limit``); None when it fits (a None bound is no bound)."""
        total = self.total + self.nodes[j].comm_bytes
        if cap_bytes is not None and total > cap_bytes:
            return "size_cap"
        if limit is not None and extra_bytes_of(self.op, total, min(self.smallest, self.nodes[j].comm_bytes),
                                                self.group_size) > limit:
            return "memory"
        return None

    def add(self, j: int) -> None:
        bj = self.nodes[j].comm_bytes
        self.members.append(j)
        self.total += bj
        self.smallest = min(self.smallest, bj)
        self.tainted.add(j)


def plan_cycles(dag: Dag, buckets: Iterable[Bucket]) -> list[int]:
    """Indices (into ``buckets``) of multi-member buckets on a dependency cycle once merged; empty if none.

    Contracts every bucket into one collective node (all members' inputs) and one wait node (all members'
    users), then runs Kahn's algorithm: O(V + E).
    """
    buckets = list(buckets)
    n = len(dag.nodes)
    rep = list(range(n))
    owner: dict[int, int] = {}
    for b_idx, b in enumerate(buckets):
        if len(b.members) < 2:
            continue
        c0 = b.members[0]
        waits = _first_waits(dag, b.members)
        w0 = waits[0]
        for m, w in zip(b.members, waits):
            rep[m] = c0
            owner[m] = b_idx
            if w is not None and w0 is not None:
                rep[w] = w0
                owner[w] = b_idx
    # Kahn's algorithm on the contracted graph: a representative's out-edges are its members' edges mapped
    # through ``rep`` (parallel edges are counted and released alike, so need no merging); every other node
    # keeps its own.  Only nodes in ``owner`` can have another representative: no scan of all n for them (the
    # order of a group's members does not change which nodes Kahn's algorithm reaches)
    members_of: dict[int, list[int]] = {}
    for i in owner:
        if rep[i] != i:
            members_of.setdefault(rep[i], [rep[i]]).append(i)
    preds, succs = dag.preds, dag.succs
    out_edges = list(succs)
    # in-degrees: a node outside every bucket keeps its own (its inputs are distinct nodes, none of them
    # itself); a representative's are its members' inputs from outside the group, recounted (the other
    # members' are never read: they are no longer nodes)
    indeg = list(map(len, preds))
    for r, group in members_of.items():
        indeg[r] = len([p for m in group for p in preds[m] if rep[p] != r])
        out_edges[r] = [v for m in group for v in succs[m]]
    reps = [r for r in range(n) if rep[r] == r]
    ready = [r for r in reps if indeg[r] == 0]
    done = 0
    while ready:
        u = ready.pop()
        done += 1
        for v in out_edges[u]:
            rv = rep[v]
            if rv != u:
                indeg[rv] -= 1
                if indeg[rv] == 0:
                    ready.append(rv)
    if done == len(reps):
        return []
    stuck = {owner[r] for r in reps if indeg[r] > 0 and r in owner}
    return sorted(stuck)


def _first_waits(dag: Dag, collectives: Sequence[int]) -> list[int | None]:
    """Each collective's first successor that is a wait, None where it has none."""
    nodes, succs = dag.nodes, dag.succs
    wait = NodeKind.WAIT  # a local: reading an enum member off its class costs several times more
    out: list[int | None] = []
    for c in collectives:
        first = None
        for s in succs[c]:
            if nodes[s].kind is wait:
                first = s
                break
        out.append(first)
    return out


def make_bucket(dag: Dag, members: Sequence[int], *, close_reason: str, label: str = "") -> Bucket:
    """A ``Bucket`` over ``members`` (sorted into graph order) with fields taken from the first member."""
    members = sorted(members)
    nodes = [dag.nodes[m] for m in members]  # once: every field below reads them
    first = nodes[0]
    sizes = [n.comm_bytes for n in nodes]
    return Bucket(
        members=members,
        op=first.collective or CollectiveOp.OTHER,
        group_name=first.group_name or "?",
        reduce_op=first.reduce_op,
        dtype=first.dtype,
        comm_bytes=sum(sizes),
        close_reason=close_reason,
        label=label,
        member_names=[n.name for n in nodes],
        params=[param_name(n) for n in nodes],
        extra_bytes=extra_bytes_bound(first.collective, sizes, first.group_size or 2),
        kept_bytes=kept_bytes_bound(dag, members),
    )


# -- memory, rank-invariant ---------------------------------------------------------------------------------

def extra_bytes_bound(op: CollectiveOp | None, member_bytes: Sequence[int], group_size: int) -> int:
    """Most bytes a bucket of collectives with payloads ``member_bytes`` can keep alive beyond what the members
    issued alone keep, in any order of the graph around it.

    A function of the payloads only, never of activation sizes, so every rank judges a bucket alike.
    All-gather: the merged output (``total``) and the copy-in of the shards (``total / group_size``) exist
    next to the members' own copies, and every member but the first-used one is gathered early
    (``total - smallest`` at most).  Reduce-scatter / all-reduce: the concatenated input (``total``) plus the
    members' inputs held until the last is ready (``total - smallest``).  A single collective adds nothing.
    """
    if len(member_bytes) < 2:
        return 0
    return extra_bytes_of(op, sum(member_bytes), min(member_bytes), group_size)


def extra_bytes_of(op: CollectiveOp | None, total: int, smallest: int, group_size: int) -> int:
    """``extra_bytes_bound`` of two or more members from their summed and smallest payloads (for a planner
    that grows a bucket one member at a time and keeps both running)."""
    held = total - smallest
    if op is not None and KINDS[op].gathers:
        return held + total + total // max(group_size, 1)
    return held + total


def kept_bytes_bound(dag: Dag, members: Sequence[int]) -> int:
    """What a bucket of all-gathers may keep alive to the end of the graph beyond its members alone: the
    payload of members whose gathered result is a graph output (a forward that keeps gathered parameters
    for the backward).  Unbucketed, the output is the gathered buffer itself; bucketed, it is a copy out of
    the merged buffer, and Inductor may materialise a second one for a view of it that is also an output.
    Unlike ``extra_bytes_bound``, these add up over buckets."""
    first = dag.nodes[members[0]].collective if members else None
    if len(members) < 2 or first is None or not KINDS[first].gathers:
        return 0
    return sum(dag.nodes[m].comm_bytes for m in members if dag.nodes[m].is_output)


BucketLimit = Union[int, Callable[[Optional[CollectiveOp]], int], None]


def bucket_limit(limit: BucketLimit, op: CollectiveOp | None) -> int | None:
    """The largest ``extra_bytes_bound`` a bucket of ``op`` may have under ``limit``: one number for every
    kind, a function of the kind, or None (no limit)."""
    return limit(op) if callable(limit) else limit


def fsdp_payload_bytes(dag: Dag, collectives: Sequence[int] | None = None) -> int:
    """Bytes the FSDP collectives of ``dag`` move (gathered parameters, gradients before the scatter): what a
    percentage ``memory_budget`` is a percentage of.  Parameter-sized, so the same on every rank whatever
    its local batch or sequence length; bucketing does not change it (a bucket moves its members' bytes).
    ``collectives``: ``dag.collectives()`` when the caller has it (a survey's), to read those nodes only."""
    nodes = dag.nodes
    return sum(nodes[c].comm_bytes for c in (dag.collectives() if collectives is None else collectives)
               if nodes[c].fsdp)


def cut_to_bound(dag: Dag, run: Sequence[int], limit: int | None, cap_bytes: int | None = None
                 ) -> list[tuple[list[int], str | None]]:
    """``run`` (collectives of one bucket key, graph order) cut greedily into pieces whose payload stays within
    ``cap_bytes`` and whose ``extra_bytes_bound`` stays within ``limit``: (members, why the piece was closed;
    None for the last piece).  A single collective always fits."""
    if not run:
        return []
    out: list[tuple[list[int], str | None]] = []
    piece = GrowingBucket(dag, run[0])
    for j in run[1:]:
        why = piece.over_bound(j, cap_bytes, limit)
        if why is None:
            piece.add(j)
        else:
            out.append((piece.members, why))
            piece.restart(j)
    out.append((piece.members, None))
    return out


def param_name(node: DagNode) -> str | None:
    """The parameter FQN a collective moves, when the graph says: ``meta['custom']['fsdp_param']`` (written
    by this package's frontend, or from Dynamo's parameter sources by the pre-grad pass), else the property
    getter the module stack went through (a parametrization frontend: ``norm`` + ``weight``)."""
    origin = node.origin
    meta = getattr(origin, "meta", None)
    if isinstance(meta, dict):
        custom = meta.get("custom")
        if isinstance(custom, dict) and isinstance(custom.get("fsdp_param"), str):
            return custom["fsdp_param"]
        from ..dag.from_fx import stack_parameter

        return stack_parameter(origin)
    return None


def break_cycles(dag: Dag, plan: BucketPlanResult, max_rounds: int = 64) -> BucketPlanResult:
    """Split buckets that would form a dependency cycle once merged (rare: needs two interleaved buckets
    whose inputs depend on each other's results) into single collectives, until the plan is acyclic."""
    for _ in range(max_rounds):
        stuck = plan_cycles(dag, plan.buckets)
        if not stuck:
            return plan
        # split the latest-starting bucket on the cycle: the earlier ones keep their merge
        victim = max(stuck, key=lambda k: plan.buckets[k].members[0])
        b = plan.buckets.pop(victim)
        for m in b.members:
            plan.buckets.append(make_bucket(dag, [m], close_reason="cycle", label=b.label))
        plan.buckets.sort(key=lambda x: x.members[0])
    raise ValueError("bucket plan still has a dependency cycle after splitting buckets")
