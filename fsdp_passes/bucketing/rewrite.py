"""Apply a bucket plan to a post-grad FX graph, in place.

Per bucket of all-gathers (dim-0 gathers of shards ``s_i``, group size ``n``)::

    flat  = copy_in_members([s_i ...])                     # one extern op: the shards, flattened, end to end
    out   = wait_tensor(all_gather_into_tensor(flat, n, group))   # row r of [n, total]: rank r's flat input
    mm    = copy_out_members(out, numels)                  # one extern op: member i's [n, numel_i] columns
                                                           # copied out, member after member
    p_i   = view(split_with_sizes(mm, n * numels)[i], full_shape_i)   # rank-major, like dim-0 gathering
                                                           # (a 1-D member: copy_in_members([...]) first)

Per bucket of reduce-scatters (inputs ``g_i`` of shape ``[n * k_i, ...]``)::

    flat  = view(bucket_cat([reshape(g_i, [n, numel_i / n]) ...], 1), [-1])   # a copy per member, placed with it
    out   = wait_tensor(reduce_scatter_tensor(flat, op, n, group))
    r_i   = view(split_with_sizes(out, [numel_i / n ...])[i], shard_shape_i)

All-reduces: ``bucket_cat`` of flattened inputs, one ``all_reduce``, pieces viewed back.

Every element travels the same way as in the unbucketed graph (same ranks, same reduction), so results are
bitwise equal.  Members' payloads are laid out in their original graph order.

Placement: the merged collective goes right after the last of its inputs (inputs that come after the first
consumer of any member are hoisted before it, with whatever they depend on), its wait right before the first
consumer of any member.  All buckets are inserted first; one stable topological sort of the whole graph then
puts every node in place (O((V + E) log V)), keeping the original order wherever nothing forces a change.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import networkx as nx
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ..dag.from_fx import op_name
from ..dag.graph import CollectiveOp, Dag, NodeKind
from ..dag.ops import classify
from .plan import Bucket, bucket_key, bucketability, plan_cycles

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

#: meta key on the merged collective and its wait: which collectives it replaced.
BUCKET_META_KEY = "fsdp_bucket"

_COPIED_META = ("nn_module_stack", "fwd_nn_module_stack", "stack_trace", "source_fn_stack", "partitioner_tag")


@dataclass
class RewriteStats:
    n_buckets: int = 0
    n_collectives_removed: int = 0
    n_nodes_added: int = 0
    collectives: list[str] = field(default_factory=list)  # names of the merged collectives, one per bucket
    moved_inputs: int = 0  # nodes hoisted so that an input is ready before the first consumer
    gathers_ahead_of_reductions: int = 0  # all-gathers issued before the reductions preceding them (placement)


def apply_buckets(graph: fx.Graph | fx.GraphModule, dag: Dag, buckets: Sequence[Bucket], *,
                  earliest: bool = False, bound_reduce_waits: bool = True) -> RewriteStats:
    """Merge each bucket of ``buckets`` (DAG ids of ``dag``, built from ``graph``) into one collective.

    The merged collective is issued right after the last of its inputs, but (unless ``earliest``) not before
    the place of its first member in the original graph: gathers of graph inputs are not all pulled to the
    start of the graph, which would keep every gathered parameter alive at once; prefetching is the
    reordering pass's decision, under its memory budget.  Its wait goes right before the first consumer of any
    member; for reduce-scatters and all-reduces (whose first consumer is often the graph output) no later than
    the next collective of the same process group (``bound_reduce_waits``), since a collective's input, the
    full-size concatenated gradients, stays allocated until its wait.

    Single-member buckets are left as they are.  Raises ``ValueError`` (naming the bucket / node) before
    touching the graph if a bucket is inconsistent or the merge would create a dependency cycle.
    """
    gm = graph if isinstance(graph, fx.GraphModule) else None
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    multi = [b for b in buckets if len(b.members) >= 2]
    stats = RewriteStats()
    if not multi:
        return stats
    _validate(g, dag, multi)

    positions: dict[fx.Node, int] = {n: i for i, n in enumerate(g.nodes)}
    prio: dict[fx.Node, tuple] = {n: (i, 0) for n, i in positions.items()}
    id_of = {dag.nodes[i].origin: i for i in range(len(dag.nodes)) if dag.nodes[i].origin is not None}
    member_bucket: dict[fx.Node, int] = {}
    for k, b in enumerate(multi):
        for m in b.members:
            c = dag.nodes[m].origin
            member_bucket[c] = k
            member_bucket[next(iter(c.users))] = k

    em = _Emitter(g, _fake_mode(dag.nodes[multi[0].members[0]].origin))
    reduce_waits: dict[fx.Node, Any] = {}  # merged reduce-scatter / all-reduce wait -> its group argument
    # erased member node -> (node standing in for it as a dependency source, as a dependency target)
    stand_in: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}
    merged: list[fx.Node] = []  # per bucket of ``multi``, its merged collective

    for k, b in enumerate(multi):
        colls = [dag.nodes[m].origin for m in b.members]
        waits = [next(iter(c.users)) for c in colls]
        inputs = [c.args[0] for c in colls]
        consumers = [u for w in waits for u in w.users]
        first_use = min(consumers, key=positions.__getitem__) if consumers else g.output_node()
        last_input = max(inputs, key=positions.__getitem__)
        if positions[last_input] > positions[first_use]:
            stats.moved_inputs += _hoist(first_use, inputs, k, positions, prio, id_of, dag, member_bucket, b)
        ready = max((prio[x] for x in inputs))
        if not earliest:
            anchor = prio[colls[0]]
            if anchor < prio[first_use]:
                ready = max(ready, anchor)

        made: list[fx.Node] = []
        with g.inserting_before(first_use):
            if b.op is CollectiveOp.ALL_GATHER:
                outs = _emit_all_gather(em, colls, waits, inputs, made)
            elif b.op is CollectiveOp.REDUCE_SCATTER:
                outs = _emit_reduce_scatter(em, colls, waits, inputs, made)
            else:
                outs = _emit_all_reduce(em, colls, waits, inputs, made)
        # made = copy-in nodes..., collective, wait, recovery nodes...
        coll_idx = next(i for i, n in enumerate(made) if n.meta.get("_fsdp_role") == "collective")
        for j, n in enumerate(made):
            if j <= coll_idx:
                prio[n] = ready + (1, k, j)
            else:
                prio[n] = (positions[first_use], -1, k, j)
            positions[n] = prio[n][0]  # a later bucket may consume these: place them at their anchor
            n.meta.pop("_fsdp_role", None)
        new_coll, new_wait = made[coll_idx], made[coll_idx + 1]
        if b.op is not CollectiveOp.ALL_GATHER:
            reduce_waits[new_wait] = _group_arg(new_coll)
        tag = {"members": [c.name for c in colls], "params": list(b.params), "label": b.label}
        new_coll.meta[BUCKET_META_KEY] = tag
        new_wait.meta[BUCKET_META_KEY] = tag
        copy_in = made[coll_idx - 1] if coll_idx > 0 else new_coll
        first_reader: dict[fx.Node, fx.Node] = {}
        for u in made[:coll_idx]:
            for a in u.all_input_nodes:
                first_reader.setdefault(a, u)
        for c, w, out in zip(colls, waits, outs):
            w.replace_all_uses_with(out)
            stand_in[c] = (copy_in, first_reader.get(c.args[0], copy_in))
            stand_in[w] = (out, out)
        for c, w in zip(colls, waits):
            g.erase_node(w)
            g.erase_node(c)
        stats.n_buckets += 1
        stats.n_collectives_removed += len(colls) - 1
        stats.n_nodes_added += len(made)
        stats.collectives.append(new_coll.name)
        merged.append(new_coll)

    extra = _ordering_edges(dag, stand_in)
    for earlier, later in _group_order_edges(dag, multi, merged):
        extra.setdefault(later, set()).add(earlier)
    _stable_sort(g, prio, extra)
    if bound_reduce_waits:
        _bound_reduce_waits(g, reduce_waits)
    g.lint()
    if gm is not None:
        gm.recompile()
    return stats


# -- validation ------------------------------------------------------------------------------------------------

def _validate(g: fx.Graph, dag: Dag, buckets: Sequence[Bucket]) -> None:
    seen: dict[int, int] = {}
    for k, b in enumerate(buckets):
        where = f"bucket {k} ({b.label or ', '.join(dag.nodes[m].name for m in b.members[:4])})"
        if list(b.members) != sorted(b.members):
            raise ValueError(f"{where}: members must be in graph order")
        keys = set()
        for m in b.members:
            if not 0 <= m < len(dag.nodes):
                raise ValueError(f"{where}: member id {m} is not a node of the DAG")
            node = dag.nodes[m]
            if m in seen:
                raise ValueError(f"{where}: collective {node.name} is already in bucket {seen[m]}")
            seen[m] = k
            if not isinstance(node.origin, fx.Node) or node.origin.graph is not g:
                raise ValueError(f"{where}: collective {node.name} is not a node of this graph")
            why = bucketability(dag, m, bucket_non_fsdp=True)
            if why:
                raise ValueError(f"{where}: collective {node.name} cannot be bucketed: {why}")
            keys.add(bucket_key(node))
        if len(keys) > 1:
            raise ValueError(
                f"{where}: members differ in (op, process group, reduce op, dtype, group size): {sorted(map(str, keys))}"
            )
    cycles = plan_cycles(dag, buckets)
    if cycles:
        names = "; ".join(", ".join(dag.nodes[m].name for m in buckets[k].members) for k in cycles)
        raise ValueError(f"merging these buckets would create a dependency cycle: {names}")


# -- placement ------------------------------------------------------------------------------------------------

def _hoist(first_use: fx.Node, inputs: list, k: int, positions: dict, prio: dict, id_of: dict, dag: Dag,
           member_bucket: dict, bucket: Bucket) -> int:
    """Give every input placed after ``first_use``, and what it depends on there, a priority just before it."""
    limit = positions[first_use]
    stack = [x for x in inputs if positions[x] > limit]
    seen = set(stack)
    moved = 0
    while stack:
        x = stack.pop()
        moved += 1
        p = (limit, -2, positions[x])
        if p < prio[x]:
            prio[x] = p
        preds = list(x.all_input_nodes)
        i = id_of.get(x)
        if i is not None:
            preds.extend(dag.nodes[q].origin for q in dag.preds[i])
        for q in preds:
            if q is None or q in seen or positions.get(q, -1) <= limit:
                continue
            owner = member_bucket.get(q)
            if owner == k:
                raise ValueError(
                    f"bucket ({', '.join(dag.nodes[m].name for m in bucket.members)}): the input {x.name} depends "
                    f"on {q.name}, the result of a member of the same bucket"
                )
            if owner is not None:
                continue  # another bucket's collective: the sort orders it
            seen.add(q)
            stack.append(q)
    return moved


def _group_order_edges(dag: Dag, multi: Sequence[Bucket], merged: Sequence[fx.Node]
                       ) -> list[tuple[fx.Node, fx.Node]]:
    """Per process group, (earlier, later) pairs chaining its collectives in the order they are issued after the
    merge: each collective keeps its place in the group's original sequence, a merged all-gather takes its
    first member's place, a merged reduction its last member's (where its last input is ready), unless a
    collective must come first because one depends on the other's result (then the dependency decides).

    The original sequences and the dependencies between collectives are the same on every rank; the graph
    around them need not be (a rank holding a padded shard has more nodes, a compute node may sit on either side
    of an input), so merged collectives are placed among the others by these alone, never by where their
    inputs happen to lie."""
    place: dict[int, tuple[str, int]] = {}
    for group, seq in dag.group_sequences().items():
        for k, c in enumerate(seq):
            place[c] = (group, k)
    # the collectives each node depends on, as a bit set over the collectives (one pass in graph order)
    bit = {c: 1 << k for k, c in enumerate(place)}
    above = [0] * len(dag.nodes)
    for v in dag.topological_order():
        a = 0
        for u in dag.preds[v]:
            a |= above[u] | bit.get(u, 0)
        above[v] = a
    items: dict[str, list[tuple[int, fx.Node, int, int]]] = {}  # group -> (place, node, member bits, needs)
    in_bucket = set()
    for b, coll in zip(multi, merged):
        in_bucket.update(b.members)
        anchor = min(b.members) if b.op is CollectiveOp.ALL_GATHER else max(b.members)
        group, k = place[anchor]
        members = needs = 0
        for m in b.members:
            members |= bit[m]
            needs |= above[m]
        items.setdefault(group, []).append((k, coll, members, needs))
    for c, (group, k) in place.items():
        if c not in in_bucket:
            items.setdefault(group, []).append((k, dag.nodes[c].origin, bit[c], above[c]))
    pairs = []
    for group_items in items.values():
        order = nx.DiGraph()
        order.add_nodes_from(range(len(group_items)))
        for i, (_, _, _, needs) in enumerate(group_items):
            for j, (_, _, members, _) in enumerate(group_items):
                if i != j and needs & members:
                    order.add_edge(j, i)
        ranked = list(nx.lexicographical_topological_sort(order, key=lambda i: group_items[i][0]))
        pairs.extend((group_items[a][1], group_items[b][1]) for a, b in zip(ranked, ranked[1:]))
    return pairs


def _ordering_edges(dag: Dag, stand_in: dict) -> dict[fx.Node, set[fx.Node]]:
    """DAG edges that are not FX data edges (mutation order), with erased nodes replaced by stand-ins."""
    extra: dict[fx.Node, set[fx.Node]] = {}
    for v in range(len(dag.nodes)):
        dst = dag.nodes[v].origin
        if dst is None:
            continue
        for u in dag.preds[v]:
            src = dag.nodes[u].origin
            if src is None:
                continue
            s = stand_in[src][0] if src in stand_in else src
            d = stand_in[dst][1] if dst in stand_in else dst
            if s is d or s in d.all_input_nodes:
                continue
            extra.setdefault(d, set()).add(s)
    return extra


def _stable_sort(g: fx.Graph, prio: dict, extra: dict) -> None:
    """Topological sort that always takes the ready node of smallest priority (then current position);
    relinks ``g`` in that order."""
    nodes = list(g.nodes)
    deps = nx.DiGraph()
    deps.add_nodes_from(nodes)
    for n in nodes:
        for d in set(n.all_input_nodes).union(extra.get(n, ())):
            if d is not n:
                deps.add_edge(d, n)
    order_key = {n: (prio[n], i) for i, n in enumerate(nodes)}
    try:
        order = list(nx.lexicographical_topological_sort(deps, key=order_key.__getitem__))
    except nx.NetworkXUnfeasible:
        cycle = [d.name for d, _ in nx.find_cycle(deps)][:8]
        raise RuntimeError(f"bucketing rewrite produced a cyclic graph around {cycle}") from None
    prev = order[0]
    for n in order[1:]:
        if prev.next is not n:
            prev.append(n)
        prev = n


def _fake_mode(node: fx.Node) -> Any:
    """The FakeTensorMode of the graph's values (None for real / meta tensors: ops then run on them directly)."""
    from torch._guards import detect_fake_mode

    vals = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def _group_arg(coll: fx.Node) -> Any:
    """The process-group argument of a functional collective (a name, or a node in compile-on-one-rank graphs)."""
    return coll.args[-1]


def _is_collective(n: fx.Node) -> bool:
    return n.op == "call_function" and classify(op_name(n))[0] is NodeKind.COLLECTIVE


def _bound_reduce_waits(g: fx.Graph, reduce_waits: dict[fx.Node, Any]) -> None:
    """Move each merged reduce-scatter / all-reduce wait before the next collective of its group, if later."""
    if not reduce_waits:
        return
    pending: dict[Any, list[fx.Node]] = {}
    wait_of = {w.args[0]: w for w in reduce_waits}
    for n in list(g.nodes):
        if n in reduce_waits:
            group = reduce_waits[n]
            if n in pending.get(group, ()):
                pending[group].remove(n)
            continue
        if not _is_collective(n):
            continue
        group = _group_arg(n)
        for w in pending.pop(group, []):
            n.prepend(w)  # its only input, the collective, is earlier; its users are all later
        if n in wait_of:
            pending.setdefault(group, []).append(wait_of[n])


# -- emitting nodes ---------------------------------------------------------------------------------------------

def _val(n: Any) -> Any:
    if isinstance(n, fx.Node):
        return n.meta["val"]
    if isinstance(n, (list, tuple)):
        return type(n)(_val(x) for x in n)
    return n


class _Emitter:
    """Creates nodes with ``meta['val']``: for a fake-tensor graph, the op's meta kernel run on the inputs'
    values and the result wrapped as fake tensors of the graph's mode, which is what the mode's dispatch does
    for these ops (views, reshapes, splits: no data, no device kernel) without its per-call overhead (about
    5x the kernel); new buffers are made directly (``fresh``)."""

    def __init__(self, g: fx.Graph, mode: Any) -> None:
        self.g = g
        self.mode = mode

    def call(self, target: Any, args: tuple, made: list, like: fx.Node, *, role: str = "",
             custom: bool = False) -> fx.Node:
        node = self.g.call_function(target, args)
        vals = tuple(_val(a) for a in args)
        if self.mode is None:
            val = target(*vals)
        else:
            with in_kernel_invocation_manager(self.mode):  # the fake values act as meta tensors
                out = target(*vals)
            device = vals[0].device
            val = type(out)(self._fake(t, device) for t in out) if isinstance(out, (list, tuple)) \
                else self._fake(out, device)
        self._finish(node, val, made, like, role, custom)
        return node

    def _fake(self, meta: torch.Tensor, device: torch.device) -> torch.Tensor:
        return FakeTensor(self.mode, meta, device)

    def fresh(self, target: Any, args: tuple, shape: Sequence[int], like_val: torch.Tensor, made: list,
              like: fx.Node, *, role: str = "", custom: bool = False) -> fx.Node:
        """A node whose output is a new contiguous buffer of ``shape`` (dtype / device of ``like_val``): its
        value is made directly instead of by running the op."""
        node = self.g.call_function(target, args)
        shape = [int(d) for d in shape]
        if self.mode is None:
            val = torch.empty(shape, dtype=like_val.dtype, device=like_val.device)  # contiguous strides
        else:
            val = self._fake(torch.empty(shape, dtype=like_val.dtype, device="meta"), like_val.device)
        self._finish(node, val, made, like, role, custom)
        return node

    def getitem(self, src: fx.Node, i: int, made: list, like: fx.Node) -> fx.Node:
        node = self.g.call_function(operator.getitem, (src, i))
        self._finish(node, src.meta["val"][i], made, like, "", True)
        return node

    @staticmethod
    def _finish(node: fx.Node, val: Any, made: list, like: fx.Node, role: str, custom: bool) -> None:
        node.meta["val"] = val
        if isinstance(val, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(val)
        for key in _COPIED_META:
            if key in like.meta:
                node.meta[key] = like.meta[key]
        if custom and "custom" in like.meta:
            node.meta["custom"] = like.meta["custom"]
        if role:
            node.meta["_fsdp_role"] = role
        made.append(node)


@torch.library.custom_op("fsdp_passes::copy_in_members_into", mutates_args=("out",))
def copy_in_members_into(members: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` (flat, every member's elements) := ``copy_in_members(members)``."""
    torch.cat([m.reshape(-1) for m in members], out=out)


@torch.library.custom_op("fsdp_passes::copy_in_members", mutates_args=())
def copy_in_members(members: list[torch.Tensor]) -> torch.Tensor:
    """A merged all-gather's input: the members' shards, flattened, end to end.

    An op of its own rather than a ``cat`` for the same reason as ``copy_out_members``: Inductor lowers a
    ``cat`` to a generated copy per member (on CPU a C++ library per distinct one), where this is one extern
    kernel (``fsdp_passes.inductor`` lowers it to ``copy_in_members_into`` writing a buffer Inductor
    allocates).  What it gives up: a shard cast to ``param_dtype`` is a kernel of its own, as without
    bucketing, and copied, where a ``cat`` computed the cast straight into its slice.  Reduction buckets keep
    the ``cat`` (see ``_emit_reduce_scatter``)."""
    out = members[0].new_empty(sum(m.numel() for m in members))
    copy_in_members_into(members, out=out)
    return out


@copy_in_members.register_fake
def _(members: list[torch.Tensor]) -> torch.Tensor:
    return members[0].new_empty(sum(m.numel() for m in members))


@torch.library.custom_op("fsdp_passes::copy_into_slot", mutates_args=("out",))
def copy_into_slot(src: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (a slice of a reduction bucket, ``src``'s shape) := ``src``."""
    out.copy_(src)


@torch.library.custom_op("fsdp_passes::bucket_cat", mutates_args=())
def bucket_cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """A reduction bucket's input: ``torch.cat(tensors, dim)``.

    An op of its own so that Inductor can lower it apart from other concatenations (``fsdp_passes.inductor``):
    as its ``cat``, each input is written into its slice of one buffer, placed with that input (so the
    peak-memory reordering leaves each gradient's matmul where it is), and an input still to be computed (a
    cast to ``reduce_dtype``) is computed straight into its slice; but an input that already is a buffer (a
    matmul's gradient, a reduction, a graph input) is copied by an extern kernel (``copy_into_slot``) rather
    than a generated copy kernel (on CPU a C++ library per distinct one)."""
    return torch.cat(tensors, dim)


@bucket_cat.register_fake
def _(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(tensors, dim)


@torch.library.custom_op("fsdp_passes::copy_out_members_into", mutates_args=("out",))
def copy_out_members_into(gathered: torch.Tensor, numels: Sequence[int], out: torch.Tensor) -> None:
    """``out`` (flat, ``gathered.numel()`` elements) := ``copy_out_members(gathered, numels)``."""
    n = gathered.numel() // sum(numels)
    blocks = out.split([n * k for k in numels])
    torch.split_with_sizes_copy(gathered.view(n, -1), list(numels), dim=1,
                                out=[b.view(n, k) for b, k in zip(blocks, numels)])


@torch.library.custom_op("fsdp_passes::copy_out_members", mutates_args=())
def copy_out_members(gathered: torch.Tensor, numels: Sequence[int]) -> torch.Tensor:
    """A merged all-gather's output reordered member-major: member i's gathered tensor (rank-major, as its own
    dim-0 all-gather returns it) is the i-th of consecutive blocks of ``n * numels[i]`` elements.

    ``gathered`` is ``n`` rows of ``sum(numels)`` elements (row r: rank r's payload, the members' shards in
    order), so member i is its ``[n, numels[i]]`` columns: not viewable as the member's shape, copied.  An op
    of its own rather than a copying reshape per member: Inductor runs it as one extern kernel
    (``split_with_sizes_copy``, a single kernel on CUDA; ``fsdp_passes.inductor`` lowers it to
    ``copy_out_members_into`` writing a buffer Inductor allocates) and generates no code for it, where a copy
    per member is a generated kernel each (on CPU a C++ library each, placed at each member's first use,
    splitting the kernels around it so that they no longer repeat from one block to the next)."""
    out = gathered.new_empty(gathered.numel())
    copy_out_members_into(gathered, numels, out=out)
    return out


@copy_out_members.register_fake
def _(gathered: torch.Tensor, numels: Sequence[int]) -> torch.Tensor:
    return gathered.new_empty(gathered.numel())


def _numel(n: fx.Node) -> int:
    return int(n.meta["val"].numel())


def _flat(em: _Emitter, x: fx.Node, made: list, like: fx.Node) -> fx.Node:
    v = x.meta["val"]
    if v.dim() == 1:
        return x
    return em.call(aten.view.default if v.is_contiguous() else aten.reshape.default, (x, [-1]), made, like)


def _wait(em: _Emitter, coll: fx.Node, made: list, like: fx.Node) -> fx.Node:
    # as in graphs Inductor builds, the wait's value is a tensor of its own (same shape), not an alias
    v = coll.meta["val"]
    return em.fresh(c10d.wait_tensor.default, (coll,), list(v.shape), v, made, like)


def gathered_into_own_buffer(collective: Any) -> bool:
    """Whether a merged all-gather copies this member (an all-gather node of the graph) out of the bucket into
    a buffer of its own (one extern ``copy_in_members``) rather than giving its readers a view: a 1-D member
    (a norm weight, a bias) is read by generated kernels, which would bake its offset in the bucket into their
    code, a different kernel source per bucket layout and a C++ compile each (8 Mistral layers: 48 distinct
    sources against 23 without the passes, 33 with this copy); matmuls read a view at any offset.  False for
    anything but a graph node with a value (a hand-built DAG's origin)."""
    val = collective.meta.get("val") if isinstance(collective, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 1


def _emit_all_gather(em: _Emitter, colls, waits, inputs, made) -> list[fx.Node]:
    _, group_size, group_name = colls[0].args[:3]
    n = int(group_size)
    like = colls[0]
    v0 = inputs[0].meta["val"]
    sizes = [_numel(x) for x in inputs]
    total = sum(sizes)
    flat = em.fresh(torch.ops.fsdp_passes.copy_in_members.default, (list(inputs),), [total], v0, made, like)
    coll = em.fresh(c10d.all_gather_into_tensor.default, (flat, group_size, group_name), [n * total], v0, made, like,
                    role="collective")
    wait = _wait(em, coll, made, like)
    if n > 1:
        # member i is the [n, numel_i] columns of [n, total], not viewable as its full shape: one extern op
        # copies every member out (see copy_out_members)
        out = em.fresh(torch.ops.fsdp_passes.copy_out_members.default, (wait, sizes), [n * total], v0, made, like)
    else:
        out = wait
    parts = em.call(aten.split_with_sizes.default, (out, [n * k for k in sizes]), made, like)
    pieces = [em.getitem(parts, i, made, w) for i, w in enumerate(waits)]
    outs = []
    for p, c, w, k in zip(pieces, colls, waits, sizes):
        if gathered_into_own_buffer(c):
            p = em.fresh(torch.ops.fsdp_passes.copy_in_members.default, ([p],), [n * k], v0, made, w)
        outs.append(em.call(aten.view.default, (p, list(w.meta["val"].shape)), made, w, custom=True))
    return outs


def _emit_reduce_scatter(em: _Emitter, colls, waits, inputs, made) -> list[fx.Node]:
    _, reduce_op, group_size, group_name = colls[0].args[:4]
    n = int(group_size)
    like = colls[0]
    v0 = inputs[0].meta["val"]
    # a concatenation, not copy_in_members: each gradient is copied into the bucket by a kernel placed with
    # it (a cast to reduce_dtype computed inside that copy), so Inductor's peak-memory reordering keeps the
    # gradients' matmuls where they are; read whole by one op at the end, they were all moved there, with
    # the bucket's issue (a 2-block Qwen2 backward: both reduce-scatters exposed at the end).  bucket_cat:
    # the copies of buffers are extern kernels (see bucket_cat)
    rows = [em.call(aten.view.default if x.meta["val"].is_contiguous() else aten.reshape.default,
                    (x, [n, _numel(x) // n]), made, c) for x, c in zip(inputs, colls)]
    sizes = [_numel(x) // n for x in inputs]
    total = sum(sizes)
    cat = em.fresh(torch.ops.fsdp_passes.bucket_cat.default, (rows, 1), [n, total], v0, made, like)
    flat = em.call(aten.view.default, (cat, [-1]), made, like)
    coll = em.fresh(c10d.reduce_scatter_tensor.default, (flat, reduce_op, group_size, group_name), [total], v0, made,
                    like, role="collective")
    wait = _wait(em, coll, made, like)
    return _split_back(em, wait, sizes, waits, made, like)


def _emit_all_reduce(em: _Emitter, colls, waits, inputs, made) -> list[fx.Node]:
    _, reduce_op, group_name = colls[0].args[:3]
    like = colls[0]
    v0 = inputs[0].meta["val"]
    flats = [_flat(em, x, made, c) for x, c in zip(inputs, colls)]  # a concatenation, as for reduce-scatters
    sizes = [_numel(x) for x in inputs]
    cat = em.fresh(torch.ops.fsdp_passes.bucket_cat.default, (flats, 0), [sum(sizes)], v0, made, like)
    coll = em.fresh(c10d.all_reduce.default, (cat, reduce_op, group_name), [sum(sizes)], v0, made, like,
                    role="collective")
    wait = _wait(em, coll, made, like)
    return _split_back(em, wait, sizes, waits, made, like)


def _split_back(em: _Emitter, flat: fx.Node, sizes: list[int], waits, made, like) -> list[fx.Node]:
    """Contiguous 1-D pieces of ``flat`` viewed as each member's output shape."""
    parts = em.call(aten.split_with_sizes.default, (flat, sizes), made, like)
    outs = []
    for i, w in enumerate(waits):
        part = em.getitem(parts, i, made, w)
        outs.append(em.call(aten.view.default, (part, list(w.meta["val"].shape)), made, w, custom=True))
    return outs


__all__ = ["BUCKET_META_KEY", "RewriteStats", "apply_buckets", "bucket_cat", "copy_in_members",
           "copy_in_members_into", "copy_into_slot", "copy_out_members", "copy_out_members_into",
           "gathered_into_own_buffer"]
