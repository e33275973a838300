"""What an operator name means for the DAG: collective, wait or compute; and process-group facts.

Both builders (FX and scheduler nodes) see the same functional-collective operator names, so the
classification lives here once.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from .collectives import KINDS
from .graph import CollectiveOp, Dag, DagNode, NodeKind

#: Ops that only change the dtype or the view of a tensor (or concatenate pieces of it): an all-gather fed
#: by a chain of these from graph inputs gathers a parameter shard; a reduce-scatter whose result reaches the
#: output through them produces a gradient.
PASS_THROUGH_OPS = frozenset({
    "convert_element_type", "_to_copy", "view", "reshape", "_unsafe_view", "clone", "t", "permute",
    "alias", "contiguous", "expand", "squeeze", "unsqueeze", "slice", "split", "split_with_sizes",
    "getitem", "detach", "as_strided", "view_as_real", "view_as_complex", "flatten", "copy",
    "cat", "copy_in_members", "bucket_cat",  # a bucket's copy-in: the concatenated shards are still parameter shards
    "constant_pad_nd",  # an uneven DTensor shard padded to the group's largest before its gather
})

#: Ops of a float8 all-gather's scaling (scale = max / amax(|shard|), the shard times the scale, clamped): an
#: all-gather of 1-byte elements fed from graph inputs by these and pass-through ops gathers a parameter shard.
FLOAT8_SCALING_OPS = frozenset({"abs", "amax", "mul", "div", "reciprocal", "clamp", "clamp_min", "clamp_max"})

# Functional collectives as they appear in post-grad graphs (torch.ops._c10d_functional.*) and in
# Inductor's collective kernels (python_kernel_name / op_overload names): each kind's ``ops``.
_COLLECTIVES: dict[str, CollectiveOp] = {name: kind.op for kind in KINDS.values() for name in kind.ops}
_WAITS = {"wait_tensor"}
_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor")


@functools.lru_cache(maxsize=4096)  # a few hundred distinct names; asked for every node, several times a pass
def op_base_name(op_name: str) -> tuple[str, str]:
    """('namespace', 'op') from 'torch.ops.ns.op.overload', 'ns.op.overload', 'ns::op' or 'op'."""
    name = op_name.replace("::", ".")
    if name.startswith("torch.ops."):
        name = name[len("torch.ops.") :]
    parts = name.split(".")
    if len(parts) >= 3:
        return parts[0], parts[1]
    if len(parts) == 2:
        # 'ns.op' or 'op.overload': a known namespace decides
        return (parts[0], parts[1]) if parts[0] in _NAMESPACES else ("", parts[0])
    return "", parts[0]


@functools.lru_cache(maxsize=4096)
def classify(op_name: str) -> tuple[NodeKind, CollectiveOp | None]:
    namespace, base = op_base_name(op_name)
    if namespace and namespace not in _NAMESPACES:
        return NodeKind.COMPUTE, None
    if base in _WAITS:
        return NodeKind.WAIT, None
    if base in _COLLECTIVES:
        return NodeKind.COLLECTIVE, _COLLECTIVES[base]
    return NodeKind.COMPUTE, None


def group_facts(group_name: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(size, global ranks) of a process group known to torch.distributed, or (None, None)."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        if not dist.is_available() or not dist.is_initialized():
            return None, None
        pg = _resolve_process_group(group_name)
        return pg.size(), tuple(dist.get_process_group_ranks(pg))
    except Exception:  # an unknown group name is only a missing fact, not an error
        return None, None


def as_int(value: Any) -> int:
    """An int from an int or a backed SymInt (its size hint); ValueError for an unbacked size."""
    if isinstance(value, int):
        return value
    import torch
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if isinstance(value, torch.SymInt):
        node = value.node
        if node.maybe_as_int() is not None:
            return int(node.maybe_as_int())
        if not free_unbacked_symbols(node.expr):
            if node.hint is not None:
                return int(node.hint)
            hint = node.shape_env.optimization_hint(node.expr, fallback=None) if node.shape_env else None
            if hint is not None:
                return int(hint)
    raise ValueError(f"size {value} has no hint (unbacked symbolic size)")


def fill_collective(node: DagNode, op: CollectiveOp, const_args: Sequence[Any], in_bytes: int, out_bytes: int) -> None:
    """Group, reduce op and payload of a functional collective from its non-tensor arguments in schema
    order (the kind's ``args``: all_gather: group_size, group_name; reduce_scatter: reduce_op, group_size,
    group_name; all_reduce: reduce_op, group_name; others: group_name last)."""
    kind = KINDS[op]
    args = list(const_args)
    group_name: Any = None
    group_size: Any = None
    if kind.args and len(args) >= len(kind.args):
        named = dict(zip(kind.args, args))
        group_size, group_name = named.get("group_size"), named["group_name"]
        if "reduce_op" in named:
            node.reduce_op = str(named["reduce_op"])
    elif args and isinstance(args[-1], str):
        group_name = args[-1]
    node.group_name = str(group_name) if group_name is not None else "?"
    size, ranks = group_facts(node.group_name)
    node.group_size = int(group_size) if isinstance(group_size, int) else size
    node.group_ranks = ranks if ranks is not None and len(ranks) == node.group_size else None
    node.comm_bytes = kind.comm_bytes(in_bytes, out_bytes)


def mark_fsdp(dag: Dag, pass_through: Callable[[int], bool], sums: Sequence[bool] | None = None,
              scaling: Callable[[int], bool] | None = None) -> None:
    """Set ``fsdp`` on the collectives of ``dag``: the one rule both views (FX, scheduler nodes) use.

    ``pass_through(i)``: node ``i`` is compute made only of ``PASS_THROUGH_OPS`` (the builder knows how its
    nodes name their ops).  Graph inputs are not nodes, so a node with no predecessor reads only graph inputs.

    - all-gather: its input comes from graph inputs through pass-through nodes only (a parameter shard,
      perhaps cast); an all-gather of another collective's result or of computed values is not FSDP;
    - reduce-scatter: its result reaches a graph output through waits and pass-through nodes, or (HSDP)
      through an all-reduce of it (a gradient), or (a tied parameter used twice) through a sum of reduced
      gradient contributions only (``sums[i]``: node ``i`` is an addition; None: no node is); and no other
      compute reads it (a forward reduce-scatter saved for backward also reaches an output);
    - all-reduce: (HSDP) fed by a reduce-scatter through waits and pass-through nodes, and its result reaches
      a graph output the same way.

    Float8 all-gathers (``scaling(i)``: node ``i`` is compute made only of pass-through and
    ``FLOAT8_SCALING_OPS``; None: no node is): an all-gather of 1-byte elements whose input comes from graph
    inputs through such nodes is FSDP.
    """
    nodes = dag.nodes

    def through(v: int) -> bool:
        return nodes[v].kind is NodeKind.WAIT or (nodes[v].kind is NodeKind.COMPUTE and pass_through(v))

    def upstream(c: int, hit: Callable[[int], bool], go_on: Callable[[int], bool]) -> bool:
        """Whether a node ``hit`` accepts lies upstream of ``c``, searching on through nodes ``go_on`` accepts."""
        stack, seen = list(dag.preds[c]), set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if hit(v):
                return True
            if go_on(v):
                stack.extend(dag.preds[v])
        return False

    def pass_through_compute(v: int) -> bool:
        return nodes[v].kind is NodeKind.COMPUTE and pass_through(v)

    def from_inputs(c: int) -> bool:
        return not upstream(c, lambda v: not pass_through_compute(v), pass_through_compute)

    def reaches_output(c: int, via_all_reduce: bool) -> bool:
        stack, seen = [c], {c}
        while stack:
            v = stack.pop()
            if nodes[v].is_output:
                return True
            for w in dag.succs[v]:
                if w in seen:
                    continue
                hsdp = via_all_reduce and nodes[w].collective is CollectiveOp.ALL_REDUCE
                if through(w) or hsdp:
                    seen.add(w)
                    stack.append(w)
        return False

    def fed_by_reduce_scatter(c: int) -> bool:
        return upstream(c, lambda v: nodes[v].collective is CollectiveOp.REDUCE_SCATTER, through)

    def reduced(v: int) -> bool:
        return nodes[v].collective is CollectiveOp.REDUCE_SCATTER or (through(v) and fed_by_reduce_scatter(v))

    def tied_sum(w: int) -> bool:
        return sums is not None and sums[w] and len(dag.preds[w]) >= 2 and all(reduced(p) for p in dag.preds[w])

    def reaches_output_via_sum(c: int) -> bool:
        # a tied parameter's gradient: the sum of its reduced contributions (not a reduction plus an
        # activation, as a sequence-parallel output plus its residual) reaches the output
        if sums is None:
            return False
        stack, seen = [c], {c}
        while stack:
            v = stack.pop()
            for w in dag.succs[v]:
                if tied_sum(w) and reaches_output(w, via_all_reduce=False):
                    return True
                if w not in seen and (through(w) or nodes[w].collective is CollectiveOp.ALL_REDUCE):
                    seen.add(w)
                    stack.append(w)
        return False

    def computed_with(c: int) -> bool:
        # a gradient's reduction is not read by compute in its own graph (only a tied parameter's sum of reduced
        # contributions); sequence parallel's forward reduce-scatter is (the residual add), even when its result
        # is also saved for backward and so reaches an output
        stack, seen = [c], {c}
        while stack:
            v = stack.pop()
            for w in dag.succs[v]:
                if w in seen:
                    continue
                seen.add(w)
                if through(w):
                    stack.append(w)
                elif nodes[w].kind is NodeKind.COMPUTE and not tied_sum(w):
                    return True
        return False

    def scaled(v: int) -> bool:
        return scaling is not None and nodes[v].kind is NodeKind.COMPUTE and scaling(v)

    def float8_from_inputs(c: int) -> bool:
        return (scaling is not None and _itemsize(nodes[c].dtype) == 1
                and not upstream(c, lambda v: not scaled(v), scaled))

    for i, node in enumerate(nodes):
        if node.kind is not NodeKind.COLLECTIVE:
            continue
        if node.collective is CollectiveOp.ALL_GATHER:
            node.fsdp = from_inputs(i) or float8_from_inputs(i)
        elif node.collective is CollectiveOp.REDUCE_SCATTER:
            node.fsdp = ((reaches_output(i, via_all_reduce=True) or reaches_output_via_sum(i))
                         and not computed_with(i))
        elif node.collective is CollectiveOp.ALL_REDUCE:
            node.fsdp = fed_by_reduce_scatter(i) and reaches_output(i, via_all_reduce=False)
        else:
            node.fsdp = False


def _itemsize(dtype: str | None) -> int | None:
    """Bytes per element of a dtype named as ``DagNode.dtype`` (``"uint8"``), None if unknown."""
    import torch

    d = getattr(torch, dtype, None) if dtype else None
    return d.itemsize if isinstance(d, torch.dtype) else None
