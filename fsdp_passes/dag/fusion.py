"""The kernels Inductor will generate for a post-grad FX graph: its DAG contracted to predicted kernels.

A post-grad graph is unfused: every cast, view and elementwise op is a node, so costing it node by node
charges a kernel launch and a round trip to memory for each, and counts a buffer for every intermediate.
Inductor runs far fewer kernels.  ``predict_kernels(dag_from_fx(graph))`` models what it does, so that the
FX-level estimate of a graph (makespan, exposed communication, peak memory) is the one the scheduler-level
DAG of the same graph gets after Inductor's fusion:

- views (``view``, ``reshape`` of a viewable layout, ``permute``, ``expand``, ``slice``, ``getitem``,
  ``_unsafe_view``...) run no kernel and allocate nothing: their users read the base buffer.  A ``reshape``
  whose input layout cannot be viewed in the new shape is a copy kernel;
- extern kernels (matmuls, convolutions, attention, ops outside aten/prims: a gather bucket's copy-in and
  copy-out ``fsdp_passes.copy_in_members`` / ``copy_out_members``) and scatters stay one kernel
  each, as do collectives and waits; a fallback kernel returning several results (an attention backward)
  writes each as its own buffer, the ones read.  An index put that Inductor lowers to its ``Scatter`` (an
  embedding's gradient accumulation) is a fused kernel: its values and mask are computed inside it and it
  fuses with its producers, never with its readers nor with the kernel of the buffer it writes into;
- pointwise and reduction ops are grouped into fused kernels.  A pointwise op read by one kernel only is
  computed inside it (Inductor inlines it at lowering); producer and consumer ops are fused when no extern
  kernel, collective or wait lies on a path between any two members (the same number of those on every
  longest path from the graph's start, which also keeps the contracted graph acyclic; a copy-out reading
  only its wait adds none, as every path through it crossed the wait), except into a
  reduction over outer dimensions (a bias gradient summed over the batch: its own kernel on CPU, with the
  pointwise ops computed inside it), from a realised pointwise op into a consumer looping over more
  elements (a returned norm weight read broadcast over the rows) and from a reduction into a consumer whose
  outer loop is not the reduction's output (the CPU backend fuses after a reduction only by outer-loop
  fusion: a bucket's rank-major copy of a gradient reduction into its strided slice runs apart); a kernel
  whose outputs are all read by one other kernel joins it (every path out of it enters that kernel);
- a pointwise op read by several kernels is computed inside each of them unless Inductor realises it
  (``should_realize_on_reuse`` on CPU: an expensive op such as ``sigmoid`` or ``exp`` in its expression, or
  more loads than ``realize_reads_threshold``), with the ops computed inside it (each reader reads their
  inputs);
- then Inductor's own fusion rounds: kernels sharing a buffer they read whole (or one writing what the other
  reads) with loops of the same size fuse, most shared bytes first, unless a path through another kernel
  joins them (a producer with a consumer that also waits for a matmul; kernels of two layers reading one
  buffer: horizontal fusion) or both reduce, to outputs of different sizes (a weight's gradient, summed over
  rows, stays apart from a normalisation's backward, summed over each row);
- a concatenation is Inductor's ``ConcatKernel`` on CPU: each input is written into its slice of the result by
  its own kernel (fused with the input's producer when that is a pointwise op only the concatenation reads),
  and the result is allocated once by a node that runs no kernel.  A reduction bucket's ``bucket_cat`` is
  that on every device, with an input that already is a buffer (a graph input, an extern kernel's, a
  reduction's or a scatter's result) copied by an extern kernel.

A fused kernel moves its external inputs (the bytes it reads of each buffer, at most the buffer) and the
outputs read outside it or returned by the graph; only those outputs are allocated (a realised member read only
inside the kernel is counted by Inductor's peak-memory estimate, not allocated), each its own buffer
(``DagNode.output_buffers``, freed after its own readers), as at the scheduler level, where buffers exist
only at fused-kernel boundaries.  A scatter into a kernel's buffer that only it reads (an embedding
gradient accumulated into zeros) writes in place, as Inductor does: it allocates nothing and its readers keep
that buffer alive.  A returned view is returned from the buffer it
resolves to here (a copying reshape's, not the gathered bucket's); a copying reshape that an ``addmm`` reads
and the graph returns through views is written twice, once for each (as Inductor does on CPU).  Each kernel
records the graph inputs it reads and which part of its outputs the graph returns, for
``memory_reorder.predict_memory_reorder``.  Collectives, waits and extern kernels keep
their fields; nodes are numbered in a topological order that keeps the graph's order where it can (a
kernel at its first member's place).  The result prices and simulates like any DAG; its nodes' ``origin``
is the FX node of the kernel's first member, so it is for estimates, not for rewriting the graph.
"""

from __future__ import annotations

import functools
import heapq
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .from_fx import _is_view, tensor_bytes
from .graph import Dag, DagNode, NodeKind, OutputBuffer
from .ops import as_int, op_base_name

__all__ = ["EXTERN_OPS", "REDUCTION_OPS", "copy_fuses_with_producer", "predict_kernels"]

#: aten ops Inductor calls as library kernels (never fused with anything)
EXTERN_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addmv", "_int_mm", "_scaled_mm", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward", "_flex_attention", "_fft_r2c", "_fft_c2r", "_fft_c2c",
})
#: ops whose output is a reduction of their input: Inductor realises their result (never inlined)
REDUCTION_OPS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "std", "argmax", "argmin", "any",
    "all", "logsumexp", "cumsum", "cumprod", "sort", "topk",
})
#: ops that make Inductor realise a pointwise value read by several kernels (on CPU)
_EXPENSIVE_OPS = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})
#: ops Inductor lowers to a view although their schema does not say so
_VIEW_OPS = frozenset({"_unsafe_view", "alias", "view_as_real", "view_as_complex", "getitem"})
#: views that copy when the input layout cannot be viewed in the new shape
_MAYBE_COPY_VIEWS = frozenset({"reshape"})
#: ops that write into another buffer (scatter-like): a kernel of their own, fused with nothing (but for the
#: index puts Inductor lowers to a ``Scatter``, ``_INDEX_PUT_OPS``)
_SCATTER_OPS = frozenset({"index_put", "index_put_", "_unsafe_masked_index_put_accumulate", "_unsafe_index_put",
                          "scatter", "scatter_add", "scatter_reduce", "index_add", "copy_"})

#: index puts Inductor lowers to a ``Scatter`` computed buffer (``index_put_impl_`` in its lowering.py): the
#: values (and the mask of ``_unsafe_masked_index_put_accumulate``, a ``where`` over them) are loaded through
#: ``values.make_loader()``, so the pointwise ops producing them are computed inside the scatter's kernel
_INDEX_PUT_OPS = frozenset({"index_put", "index_put_", "_unsafe_index_put", "_unsafe_masked_index_put_accumulate"})

#: a merged all-gather's copy-out (``bucketing.rewrite.copy_out_members``): an extern kernel reading the wait
_COPY_OUT_OPS = frozenset({("fsdp_passes", "copy_out_members")})

_COMM, _EXTERN, _FUSABLE, _NOP = "comm", "extern", "fusable", "nop"


@dataclass
class _Unit:
    """One would-be kernel before grouping: an FX node, or one input's copy of a concatenation."""

    kind: str
    members: list[int]  # DAG node ids (a concatenation copy: none)
    pos: float  # place in the graph order
    preds: list[int] = field(default_factory=list)  # unit ids
    after: list[int] = field(default_factory=list)  # units it must follow without reading them (order only)
    inlinable: bool = False  # a pointwise op Inductor computes inside its reader
    fuses_with_producers: bool = True  # False for a reduction over outer dimensions
    loop_numel: int = 0  # elements its loop runs over (the largest of its input and output tensors)
    reduction_numel: int = 0  # a reduction: elements of its output (the loop it nests its reduction in)
    # a concatenation copy: elements of its outermost loop (a slice along an inner dimension is strided, so its
    # rows do not merge into one loop); 0: a loop starting with its producers' loops, as assumed elsewhere
    outer_loop: int = 0
    # (owner unit or None for a graph input, buffer key, bytes read, bytes of the whole buffer)
    reads: list[tuple[int | None, Any, int, int]] = field(default_factory=list)
    writes_into: int = 0  # bytes a concatenation copy writes into the concatenation's buffer
    out_bytes: int = 0
    graph_output: bool = False
    # a copying reshape returned through views: when an ``addmm`` reads it too, Inductor copies it once for
    # the addmm (in the addmm's lowering) and once for the returned value (seen on CPU; ``mm`` shares one)
    output_copy: bool = False
    # a scatter writing into its first input, a kernel's buffer only it reads (Inductor reuses the buffer):
    # that input's unit; the scatter allocates nothing and its readers keep the input's buffer alive
    in_place_of: int | None = None
    # an index put lowered to Inductor's ``Scatter``: a fused kernel that computes its values inside, after
    # its producers' ops; its readers never fuse with it (its atomic adds need every write done before a read)
    # and the buffer it writes into is realised apart (``self.realize()``, read through a ``StarDep``)
    scatter: bool = False
    scatter_target: "_Unit | None" = None  # the unit whose buffer it writes into (a copy of it)


def _base_op(node: DagNode) -> tuple[str, str]:
    return op_base_name(node.op) if node.op != "getitem" else ("", "getitem")


def _val(fx_node: Any) -> Any:
    return getattr(fx_node, "meta", {}).get("val")


def _is_view_node(node: DagNode) -> bool:
    origin = node.origin
    if origin is None or node.kind is not NodeKind.COMPUTE:
        return False
    return _is_view(origin) or _base_op(node)[1] in _VIEW_OPS


def _copies(node: DagNode) -> bool:
    """A ``reshape`` whose input's layout cannot be viewed in the output shape: Inductor copies."""
    if _base_op(node)[1] not in _MAYBE_COPY_VIEWS:
        return False
    origin = node.origin
    inputs = origin.all_input_nodes
    src, out = (_val(inputs[0]) if inputs else None), _val(origin)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    try:
        layout = (tuple(as_int(d) for d in src.shape), tuple(as_int(s) for s in src.stride()),
                  tuple(as_int(d) for d in out.shape))
    except ValueError:  # an unbacked size: assume the common case, a view
        return False
    return not _viewable(*layout)


@functools.lru_cache(maxsize=4096)
def _viewable(shape: tuple[int, ...], stride: tuple[int, ...], out_shape: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` / ``stride`` can be viewed as ``out_shape``, as torch decides it.  Asked
    once per distinct layout: a repeated block asks the same, and inside a compile the probe's ``view`` runs
    through the Python dispatcher (about 0.1 ms a call)."""
    probe = torch.empty_strided(shape, stride, dtype=torch.uint8, device="meta")
    try:
        probe.view(out_shape)
    except (RuntimeError, ValueError):  # ValueError: torch's Python reference (inside a compile) refusing it
        return False
    return True


def _is_pointwise(node: DagNode) -> bool:
    """Elementwise: no input has more elements than the output (broadcasts included)."""
    out = _val(node.origin)
    if not isinstance(out, torch.Tensor):
        return False
    try:
        n_out = as_int(out.numel())
        for a in node.origin.all_input_nodes:
            v = _val(a)
            if isinstance(v, torch.Tensor) and as_int(v.numel()) > n_out:
                return False
    except ValueError:
        return False
    return True


def _reduces_inner_dims(node: DagNode) -> bool:
    """A reduction over the input's innermost dimensions (a row reduction): its loop nest starts with the
    producer's outer loops, so the CPU backend fuses it with the producer.  A reduction over outer dimensions
    (a bias gradient summed over the batch) runs as a kernel of its own."""
    origin = node.origin
    args = origin.args
    src = _val(args[0]) if args and hasattr(args[0], "meta") else None
    if not isinstance(src, torch.Tensor):
        return True
    ndim = src.dim()
    dims = args[1] if len(args) > 1 else origin.kwargs.get("dim")
    if dims is None:
        return True  # a full reduction
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not all(isinstance(d, int) for d in dims) or not ndim:
        return True
    norm = sorted(d % ndim for d in dims)
    return norm == list(range(ndim - len(norm), ndim))


#: ops that look their first input up by index: their loop runs over the indices (the output), not the table
_LOOKUP_OPS = frozenset({"embedding", "index", "index_select", "gather"})


def _loop_numel(node: DagNode) -> int:
    inputs = node.origin.all_input_nodes
    table = node.origin.args[0] if _base_op(node)[1] in _LOOKUP_OPS and node.origin.args else None
    sizes = [_val(node.origin)] + [_val(a) for a in inputs if a is not table]
    try:
        return max((as_int(v.numel()) for v in sizes if isinstance(v, torch.Tensor)), default=0)
    except ValueError:
        return 0


def _numel(value: Any) -> int:
    try:
        return as_int(value.numel()) if isinstance(value, torch.Tensor) else 0
    except ValueError:
        return 0


#: Inductor's ``config.unroll_reductions_threshold`` (held against the installed Inductor by
#: tests/inductor/test_inductor_defaults.py)
UNROLL_REDUCTIONS_THRESHOLD = 8


def _unrolled(node: DagNode) -> bool:
    """A reduction over fewer than ``unroll_reductions_threshold`` elements per output, which Inductor lowers to
    a pointwise sum of loads (not a full reduction: nothing stops its fusion with a consumer)."""
    out = _numel(_val(node.origin))
    inputs = node.origin.all_input_nodes
    src = _numel(_val(inputs[0])) if inputs else 0
    return out > 1 and 0 < src < UNROLL_REDUCTIONS_THRESHOLD * out


def _lowered_scatter(node: DagNode) -> bool:
    """An index put that Inductor lowers to a ``Scatter`` (``index_put_impl_``), not to its fallback kernel: no
    boolean index and, when it accumulates, an output dtype with an atomic add (not int64 or bool)."""
    origin = node.origin
    base = _base_op(node)[1]
    if base not in _INDEX_PUT_OPS or not isinstance(origin, fx.Node):
        return False
    masked = base == "_unsafe_masked_index_put_accumulate"
    indices = origin.args[2 if masked else 1] if len(origin.args) > (2 if masked else 1) else None
    if not isinstance(indices, (list, tuple)):
        return False
    for index in indices:
        v = _val(index) if isinstance(index, fx.Node) else None
        if index is not None and (not isinstance(v, torch.Tensor) or v.dtype in (torch.bool, torch.uint8)):
            return False
    accumulate = masked or (origin.args[3] if len(origin.args) > 3 else origin.kwargs.get("accumulate", False))
    out = _val(origin)
    return isinstance(out, torch.Tensor) and not (accumulate and out.dtype in (torch.int64, torch.bool))


def _scatter_values(node: DagNode) -> Any:
    """The FX node of an index put's values (its last tensor argument)."""
    args = node.origin.args
    return args[3] if _base_op(node)[1] == "_unsafe_masked_index_put_accumulate" else args[2]


def _slice_outer_loop(fx_input: Any, dim: Any) -> int:
    """Elements of the outermost loop of a concatenation's copy of ``fx_input`` along ``dim``: along the
    outermost non-trivial dimension the slice is one contiguous run (one loop over every element); along an
    inner one each row before ``dim`` starts a new run, so the copy loops over those rows outside."""
    v = _val(fx_input)
    numel = _numel(v)
    if not isinstance(v, torch.Tensor) or not isinstance(dim, int) or not v.dim():
        return numel
    try:
        rows = 1
        for d in v.shape[:dim % v.dim()]:
            rows *= as_int(d)
    except ValueError:
        return numel
    return rows if rows > 1 else numel


def _fuses_into(producer: _Unit, consumer: _Unit) -> bool:
    """Whether the CPU backend fuses ``consumer`` with the ``producer`` it reads.  A reduction fuses with a
    consumer only by outer-loop fusion: the consumer's outermost loop must be the reduction's output (a
    concatenation's copy of a reduction into a strided slice, a bucket's rank-major copy-in, runs apart); a
    reduction over outer dimensions runs its own loop whatever it reads."""
    if not consumer.fuses_with_producers or producer.scatter or consumer.scatter_target is producer:
        return False
    return not (producer.reduction_numel and consumer.outer_loop and consumer.outer_loop != producer.reduction_numel)


def _broadcast_into(producer: _Unit, consumer: _Unit) -> bool:
    """A realised pointwise producer whose loop runs over fewer elements than its consumer's (a gathered norm
    weight the graph returns, read broadcast over the rows): the CPU backend fuses pointwise kernels only
    with the same loop ranges or the same number of elements (``CppScheduling._why_fuse_nodes``), so it
    stays a kernel of its own."""
    return bool(producer.members) and not producer.reduction_numel and producer.loop_numel < consumer.loop_numel


def _bytes(value: Any) -> int:
    try:
        return tensor_bytes(value)
    except ValueError:
        return 0


def _device_type(node: DagNode) -> str:
    v = _val(node.origin)
    if isinstance(v, (list, tuple)):
        v = next((x for x in v if isinstance(x, torch.Tensor)), None)
    return v.device.type if isinstance(v, torch.Tensor) else "cpu"


class _Groups:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, u: int) -> int:
        root = u
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[u] != root:
            self.parent[u], u = root, self.parent[u]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def copy_fuses_with_producer(dag: Dag, i: int) -> bool:
    """Whether a concatenation's copy of node ``i``'s first input (a reduction bucket's copy-in of a
    collective's input) runs inside the kernel computing that input: true when the input is, through views,
    a pointwise op (a cast to the reduction's dtype) that nothing else reads, which Inductor computes straight
    into its slice of the concatenation; the merge then adds no kernel for it.  A graph input (a parameter's shard
    itself) or the result of an extern kernel or a reduction is copied by a kernel of its own (an extern
    kernel, ``bucket_cat``'s ``copy_into_slot``)."""
    origin = dag.nodes[i].origin
    if not isinstance(origin, fx.Node) or not origin.args or not isinstance(origin.args[0], fx.Node):
        return False
    src, reader = origin.args[0], origin
    while True:
        j = dag.index.get(src.name)
        if j is None or len(src.users) != 1 or reader not in src.users:
            return False  # a graph input, or a value something else reads too
        node = dag.nodes[j]
        if not (_is_view_node(node) and not _copies(node)):
            break
        if not src.all_input_nodes:
            return False
        src, reader = src.all_input_nodes[0], src
    # the pointwise ops computed for the copy alone, back to the kernels or graph inputs they read: a
    # reduction among those stays apart from the copy (the CPU backend fuses after a reduction only by
    # outer-loop fusion), so the merge splits a kernel that ran fused in two
    stack, seen = [j], {j}
    while stack:
        k = stack.pop()
        node = dag.nodes[k]
        if node.kind is not NodeKind.COMPUTE:
            return False
        namespace, base = _base_op(node)
        if (namespace not in ("aten", "prims", "") or base in EXTERN_OPS or base in REDUCTION_OPS
                or base in _SCATTER_OPS or base == "cat" or not _is_pointwise(node)):
            return False
        for a in node.origin.all_input_nodes:
            p = dag.index.get(a.name)
            if p is None or p in seen:
                continue  # a graph input
            producer = dag.nodes[p]
            if producer.kind is not NodeKind.COMPUTE or _base_op(producer)[1] in EXTERN_OPS:
                continue  # read from a collective's or an extern kernel's buffer
            if _base_op(producer)[1] in REDUCTION_OPS or len(a.users) != 1:
                return False  # a reduction's kernel, or a value other kernels read too
            seen.add(p)
            stack.append(p)
    return True


def predict_kernels(dag: Dag) -> Dag:
    """``dag`` (from ``dag_from_fx``) contracted to the kernels Inductor is predicted to generate.

    Nodes without an FX origin (hand-built DAGs) are kept as they are.  See the module docstring.
    """
    nodes = dag.nodes
    n = len(nodes)
    # -- 1. views: which buffer each node's value lives in (a view lives in its base's; a graph input: None)
    is_view = [False] * n
    for i, node in enumerate(nodes):
        if isinstance(node.origin, fx.Node) and _is_view_node(node) and not _copies(node):
            is_view[i] = True
    owner_node: list[int | None] = list(range(n))  # DAG node owning the buffer (None: a graph input)
    for i in range(n):
        if is_view[i]:
            base = nodes[i].origin.all_input_nodes
            b = dag.index.get(base[0].name) if base else None
            owner_node[i] = owner_node[b] if b is not None else None

    # -- 2. units: one per non-view node; a concatenation: one copy unit per input plus a no-kernel owner
    unit_of: list[int | None] = [None] * n
    units: list[_Unit] = []
    for i, node in enumerate(nodes):
        if is_view[i]:
            continue
        scatter = False
        if node.kind is not NodeKind.COMPUTE or not isinstance(node.origin, fx.Node):
            kind = _COMM if node.kind is not NodeKind.COMPUTE else _EXTERN
        else:
            namespace, base = _base_op(node)
            if base == "bucket_cat" or base == "cat" and _device_type(node) == "cpu":
                kind = _NOP
            elif _lowered_scatter(node):
                kind, scatter = _FUSABLE, True
            elif base in EXTERN_OPS or base in _SCATTER_OPS or namespace not in ("aten", "prims", ""):
                kind = _EXTERN  # a scatter writes a realised buffer in a kernel of its own, too
            else:
                kind = _FUSABLE
        unit_of[i] = len(units)
        u = _Unit(kind=kind, members=[i], pos=float(i))
        if scatter:
            u.scatter = True  # its loop runs over the values it adds
            u.loop_numel = _numel(_val(_scatter_values(node)))
        elif kind is _FUSABLE:
            base = _base_op(node)[1]
            u.inlinable = base not in REDUCTION_OPS and _is_pointwise(node)
            u.fuses_with_producers = base not in REDUCTION_OPS or _reduces_inner_dims(node)
            u.loop_numel = _loop_numel(node)
            if base in REDUCTION_OPS and not _unrolled(node):
                u.reduction_numel = _numel(_val(node.origin))
        units.append(u)
    for i in range(n):
        if is_view[i] and owner_node[i] is not None:
            unit_of[i] = unit_of[owner_node[i]]

    def _output_key(o: int, fx_input: fx.Node) -> Any:
        """The key of the buffer ``fx_input`` lives in: its owner node's id, or (id, k) for the k-th result of a
        node returning several (a fallback kernel's: each result its own buffer)."""
        owner = nodes[o].origin
        if not isinstance(_val(owner), (list, tuple)):
            return o
        item = fx_input
        while item.all_input_nodes and item.all_input_nodes[0] is not owner:
            item = item.all_input_nodes[0]
        if item is not owner and item.target is operator.getitem and isinstance(item.args[1], int):
            return (o, item.args[1])
        return o

    def read_of(fx_input: Any) -> tuple[int | None, Any, int, int]:
        """(unit owning the buffer ``fx_input`` lives in, buffer key, bytes read, buffer bytes)."""
        nbytes = _bytes(_val(fx_input))
        j = dag.index.get(fx_input.name)
        if j is not None and owner_node[j] is not None:
            o = owner_node[j]
            return unit_of[o], _output_key(o, fx_input), nbytes, nodes[o].out_bytes or _bytes(_val(nodes[o].origin)) or nbytes
        root = fx_input  # a graph input, or a view of one
        while dag.index.get(root.name) is not None and root.all_input_nodes:
            root = root.all_input_nodes[0]
        return None, root.name, nbytes, _bytes(_val(root)) or nbytes

    for i, node in enumerate(nodes):
        uid = unit_of[i]
        if is_view[i] or uid is None:
            continue
        unit = units[uid]
        origin = node.origin
        if unit.kind is _NOP:
            # ConcatKernel: a copy unit per input writes that input's bytes into the result's slice
            copies = []
            cat_dim = origin.args[1] if len(origin.args) > 1 else origin.kwargs.get("dim", 0)
            bucket_cat = _base_op(node)[1] == "bucket_cat"
            for a in origin.args[0] if origin.args and isinstance(origin.args[0], (list, tuple)) else []:
                if not isinstance(a, fx.Node):
                    continue
                r = read_of(a)
                src_unit = r[0]
                # a bucket_cat copies a buffer (a graph input, an extern kernel's or a reduction's result, a
                # scatter's) by an extern kernel; a pointwise op it reads is computed into the slice
                extern = bucket_cat and (src_unit is None or units[src_unit].kind is not _FUSABLE
                                         or units[src_unit].scatter or not units[src_unit].inlinable)
                c = _Unit(kind=_EXTERN if extern else _FUSABLE, members=[], pos=i - 0.5, writes_into=r[2],
                          outer_loop=_slice_outer_loop(a, cat_dim))
                c.reads.append(r)
                if src_unit is not None:
                    c.preds.append(src_unit)
                copies.append(len(units))
                units.append(c)
            unit.preds.extend(copies)
            unit.out_bytes = node.out_bytes
            continue
        if isinstance(origin, fx.Node):
            for a in origin.all_input_nodes:
                r = read_of(a)
                src_unit = r[0]
                unit.reads.append(r)
                if src_unit is not None and src_unit != uid:
                    unit.preds.append(src_unit)
        # a copying reshape allocates its result (the FX DAG counts it as a view)
        unit.out_bytes = _bytes(_val(origin)) if node.alias_of is not None and unit.kind is _FUSABLE else node.out_bytes
    # dependencies that are not reads (mutation order, hand-built edges)
    for a, b in dag.edges():
        ua, ub = unit_of[a], unit_of[b]
        if ua is not None and ub is not None and ua != ub and ua not in units[ub].preds:
            if units[ub].kind is _NOP:
                continue  # a concatenation reads its inputs through its copy units
            units[ub].preds.append(ua)
    # each process group's collectives stay in their order (Inductor chains them before fusing, so no kernel
    # spans two of them either)
    for seq in dag.group_sequences().values():
        for a, b in zip(seq, seq[1:]):
            if unit_of[a] is not None and unit_of[b] is not None:
                units[unit_of[b]].after.append(unit_of[a])
    _mark_graph_outputs(dag, units, unit_of, owner_node, is_view)
    _recompute_cheap_pointwise(units, nodes)

    m = len(units)
    succs: list[list[int]] = [[] for _ in range(m)]
    for v, u in enumerate(units):
        u.preds = sorted(set(u.preds))
        for p in u.preds:
            succs[p].append(v)
    topo = _topological(units)
    for u in units:
        if u.scatter and u.reads and u.reads[0][0] is not None:
            u.scatter_target = units[u.reads[0][0]]
        extern_scatter = u.kind is _EXTERN and u.members and _base_op(nodes[u.members[0]])[1] in _SCATTER_OPS
        if (u.scatter or extern_scatter) and u.reads:
            o = u.reads[0][0]
            if (o is not None and units[o].kind is _FUSABLE and units[o].members and not units[o].graph_output
                    and len(set(succs[o])) == 1):
                u.in_place_of = o

    # -- 3. grouping: barrier depth (extern kernels, collectives, waits, concatenations on a longest path)
    # an extern kernel that reads only barriers' outputs (a bucket's copy-out, which reads its wait) adds no
    # depth: every path into it already crossed a barrier, so kernels on either side stay apart anyway, and
    # Inductor fuses across it (a norm weight copied out is multiplied inside the kernel of the norm before it)
    passes_depth = [u.kind is _EXTERN and bool(u.members) and bool(u.preds) and not u.after
                    and _base_op(nodes[u.members[0]]) in _COPY_OUT_OPS
                    and all(units[p].kind not in (_FUSABLE, _NOP) for p in u.preds) for u in units]
    depth = [0] * m
    for v in topo:
        d = 0
        for p in units[v].preds + units[v].after:
            d = max(d, depth[p] + (0 if units[p].kind is _FUSABLE or passes_depth[p] else 1))
        depth[v] = d
    groups = _Groups(m)
    # a pointwise op read by exactly one fusable unit is computed inside it (whatever its depth)
    inlined_into: dict[int, int] = {}
    for v in reversed(topo):
        u = units[v]
        if u.kind is not _FUSABLE or not u.inlinable or u.graph_output or not u.members:
            continue
        readers = set(succs[v])
        if len(readers) == 1:
            (r,) = readers
            if units[r].kind is _FUSABLE and units[r].scatter_target is not u:
                inlined_into[v] = r
    eff_depth = list(depth)
    for v in reversed(topo):
        if v in inlined_into:
            eff_depth[v] = eff_depth[inlined_into[v]]
            # computed inside a reduction over outer dimensions, it runs in that loop, apart from its producers
            units[v].fuses_with_producers = units[v].fuses_with_producers and units[inlined_into[v]].fuses_with_producers
    for v in topo:
        if units[v].kind is not _FUSABLE:
            continue
        if v in inlined_into:
            groups.union(v, inlined_into[v])
        for p in units[v].preds:
            if (units[p].kind is _FUSABLE and p not in inlined_into and depth[p] == eff_depth[v]
                    and _fuses_into(units[p], units[v]) and not _broadcast_into(units[p], units[v])):
                groups.union(p, v)

    # a kernel all of whose outputs are read by one other kernel joins it: every path out of it enters that
    # kernel first, so no cycle can form (an op recomputed from saved inputs in a backward, whatever its depth)
    group_members: dict[int, list[int]] = {}
    for v in range(m):
        group_members.setdefault(groups.find(v), []).append(v)
    for v in reversed(topo):
        r = groups.find(v)
        if units[v].kind is not _FUSABLE or r != v and groups.find(r) != r:
            continue
        members = group_members.get(r)
        if not members or any(units[w].graph_output for w in members):
            continue
        readers = {groups.find(s) for w in members for s in succs[w]} - {r}
        if len(readers) != 1:
            continue
        (g,) = readers
        if units[g].kind is not _FUSABLE or not all(_fuses_into(units[p], units[w]) for w in group_members[g]
                                                    for p in units[w].preds if groups.find(p) == r):
            continue
        groups.union(r, g)
        joined = group_members.pop(r, []) + group_members.pop(g, [])
        group_members[groups.find(r)] = joined

    _fuse_sharing_kernels(units, succs, groups, topo)

    # -- 4. one DAG node per group / kept unit
    group_members = {}
    for v in range(m):
        group_members.setdefault(groups.find(v), []).append(v)
    return _contract(dag, units, succs, groups, group_members, set(inlined_into))


#: Inductor's ``config.realize_reads_threshold`` (its default; held against the installed Inductor by
#: tests/inductor/test_inductor_defaults.py): a pointwise op that loads more buffers is realised, not recomputed
REALIZE_READS_THRESHOLD = 4


def _recompute_cheap_pointwise(units: list[_Unit], nodes: list[DagNode]) -> None:
    """A pointwise op read by several fused kernels is computed inside each of them unless Inductor realises
    it (``should_realize_on_reuse`` on CPU: its expression, with the producers computed inside it, uses an
    expensive op such as ``exp`` or ``sigmoid``, or loads more than ``realize_reads_threshold`` buffers):
    every reader but the first reads its inputs instead of its buffer, and the first computes it inside."""
    max_reads = REALIZE_READS_THRESHOLD
    readers: list[list[int]] = [[] for _ in units]
    for v, u in enumerate(units):
        for p in dict.fromkeys(u.preds):
            readers[p].append(v)
    topo = _topological(units)
    heavy = [False] * len(units)
    loads: list[set[Any]] = [set() for _ in units]
    # what computing a unit with the ops inside it reads: its preds and reads, those of the ops inside expanded
    leaf_preds: list[list[int]] = [[] for _ in units]
    leaf_reads: list[list[tuple[int | None, Any, int, int]]] = [[] for _ in units]
    recompute: list[int] = []
    for v in topo:
        u = units[v]
        if u.kind is not _FUSABLE or not u.members:
            continue
        inner = [p for p in dict.fromkeys(u.preds) if units[p].kind is _FUSABLE and units[p].inlinable
                 and not units[p].graph_output and units[p].members and (readers[p] == [v] or p in recompute)]
        heavy[v] = _base_op(nodes[u.members[0]])[1] in _EXPENSIVE_OPS or any(heavy[p] for p in inner)
        loads[v] = {r[1] for r in u.reads if r[0] not in inner}.union(*(loads[p] for p in inner))
        leaf_preds[v] = list(dict.fromkeys([p for p in u.preds if p not in inner]
                                           + [q for p in inner for q in leaf_preds[p]]))
        leaf_reads[v] = list(dict.fromkeys([r for r in u.reads if r[0] not in inner]
                                           + [r for p in inner for r in leaf_reads[p]]))
        if (u.inlinable and not u.graph_output and len(readers[v]) > 1 and not heavy[v]
                and len(loads[v]) <= max_reads
                and all(units[r].kind is _FUSABLE and units[r].members for r in readers[v])):
            recompute.append(v)
    # who reads each unit, kept up to date as readers are rewired below
    reading: list[set[int]] = [set() for _ in units]
    for r, u in enumerate(units):
        for p in u.preds:
            reading[p].add(r)
    for v in reversed(recompute):  # later ones first: their readers then read these ones
        rs = sorted(reading[v], key=lambda r: units[r].pos)
        for r in rs[1:]:  # each computes it with the ops computed inside it (read by it alone), from their inputs
            reader = units[r]
            reader.preds = [p for p in reader.preds if p != v] + leaf_preds[v]
            reader.reads = [rd for rd in reader.reads if rd[0] != v] + leaf_reads[v]
            reading[v].discard(r)
            for p in leaf_preds[v]:
                reading[p].add(r)


def _fuse_sharing_kernels(units: list[_Unit], succs: list[list[int]], groups: _Groups, topo: list[int]) -> None:
    """Inductor's own fusion rounds on the predicted kernels: two kernels that share a buffer (one writes what
    the other reads, or both read it) and run loops of the same size fuse, the most shared bytes first, unless
    a path through another kernel joins them (the fused kernel would depend on itself).  This fuses what the
    rules above keep apart: a producer with a consumer that also waits for an extern kernel (it runs later,
    with that consumer), and kernels of different layers reading the same buffer (horizontal fusion)."""
    m = len(units)
    rank = {v: k for k, v in enumerate(topo)}
    for _ in range(10):  # Inductor's rounds
        members: dict[int, list[int]] = {}
        for v in range(m):
            members.setdefault(groups.find(v), []).append(v)
        fusable = {r for r, ms in members.items()
                   if all(units[v].kind is _FUSABLE and units[v].members and not units[v].writes_into for v in ms)}
        gsuccs: dict[int, set[int]] = {r: set() for r in members}
        for v in range(m):
            for p in units[v].preds + units[v].after:
                rp, rv = groups.find(p), groups.find(v)
                if rp != rv:
                    gsuccs[rp].add(rv)
        # descendants of every kernel, as bit sets, latest kernels first
        gpreds = {r: set() for r in members}
        for r, ss in gsuccs.items():
            for t in ss:
                gpreds[t].add(r)
        order = _ordered_by(gpreds, {r: min(rank[v] for v in members[r]) for r in members})[::-1]
        bit = {r: 1 << k for k, r in enumerate(order)}
        desc: dict[int, int] = {}
        for r in order:
            d = 0
            for s in gsuccs[r]:
                d |= bit[s] | desc[s]
            desc[r] = d
        numel = {r: max(units[v].loop_numel for v in members[r]) for r in fusable}
        # the reductions' output sizes: two kernels reducing fuse only when they reduce alike (the same loop
        # over the same output: a column reduction, a weight's gradient, stays apart from a row reduction)
        reduced = {r: {units[v].reduction_numel for v in members[r]} - {0} for r in fusable}
        # shared buffers: key -> (bytes, kernels using it)
        users: dict[Any, set[int]] = {}
        size: dict[Any, int] = {}
        for r in fusable:
            for v in members[r]:
                for src, key, nbytes, whole in units[v].reads:
                    if src is not None and groups.find(src) == r or nbytes < whole:
                        continue  # a slice: kernels reading different parts of a buffer share nothing
                    k = ("unit", src) if src is not None else ("input", key)
                    users.setdefault(k, set()).add(r)
                    size[k] = max(size.get(k, 0), min(nbytes, whole))
                    if src is not None and groups.find(src) in fusable:
                        users[k].add(groups.find(src))
        score: dict[tuple[int, int], int] = {}
        for k, rs in users.items():
            rs = sorted(rs)
            for i, a in enumerate(rs):
                for b in rs[i + 1:]:
                    if numel[a] == numel[b] and (not reduced[a] or not reduced[b] or reduced[a] == reduced[b]):
                        score[(a, b)] = score.get((a, b), 0) + size[k]
        merged: set[int] = set()
        for (a, b), _ in sorted(score.items(), key=lambda kv: (-kv[1], kv[0])):
            if a in merged or b in merged:
                continue
            if desc[a] & bit[b]:
                first, second = a, b
            elif desc[b] & bit[a]:
                first, second = b, a
            else:
                first, second = a, None
            if second is not None:
                # a consumer the backend does not fuse with what it reads (see _fuses_into)
                if not all(_fuses_into(units[p], units[v]) for v in members[second]
                           for p in units[v].preds if groups.find(p) == first):
                    continue
                if any(desc[s] & bit[second] for s in gsuccs[first] if s != second):
                    continue  # a path through another kernel
            merged.update((a, b))
            groups.union(a, b)
            # the fused kernel is one node from now on: what reached either reaches both and what follows
            # either, so a later pair of this round joined through it is seen as joined
            both, after = bit[a] | bit[b], desc[a] | desc[b]
            bit[a] = bit[b] = both
            for r in order:
                if desc[r] & both or r in (a, b):
                    desc[r] |= both | after
        if not merged:
            return


def _reads_as_addmm(unit: _Unit, nodes: list[DagNode]) -> bool:
    return unit.kind is _EXTERN and bool(unit.members) and _base_op(nodes[unit.members[0]])[1] == "addmm"


def _mark_graph_outputs(dag: Dag, units: list[_Unit], unit_of: list[int | None], owner_node: list[int | None],
                        is_view: list[bool]) -> None:
    """Flag the units whose buffers the graph returns.  A returned view lives in the buffer the view resolves to
    here (a copying reshape owns its buffer), not in the one ``dag_from_fx`` marks (it counts every reshape
    as a view)."""
    import torch.fx as fx

    nodes = dag.nodes
    graph = next((n.origin.graph for n in nodes if isinstance(n.origin, fx.Node)), None)
    for i, node in enumerate(nodes):  # nodes without an FX origin: as they are marked
        if node.is_output and unit_of[i] is not None and not isinstance(node.origin, fx.Node):
            units[unit_of[i]].graph_output = True
    if graph is None:
        return
    for out in graph.find_nodes(op="output"):
        for value in out.all_input_nodes:
            j = dag.index.get(value.name)
            if j is None or owner_node[j] is None or unit_of[owner_node[j]] is None:
                continue  # a graph input (or a view of one)
            o = owner_node[j]
            unit = units[unit_of[o]]
            unit.graph_output = True
            if j != o and nodes[o].alias_of is not None and unit.kind is _FUSABLE:
                unit.output_copy = True


def _ordered_by(preds: dict[int, set[int]], priority: dict[int, int]) -> list[int]:
    """Kahn's topological order of the keys of ``preds`` (id -> ids it comes after), the lowest ``priority``
    first among the ready ones; shorter than ``preds`` when there is a cycle."""
    succs: dict[int, list[int]] = {v: [] for v in preds}
    for v, ps in preds.items():
        for p in ps:
            succs[p].append(v)
    indeg = {v: len(ps) for v, ps in preds.items()}
    ready = [(priority[v], v) for v in preds if indeg[v] == 0]
    heapq.heapify(ready)
    out: list[int] = []
    while ready:
        _, v = heapq.heappop(ready)
        out.append(v)
        for s in succs[v]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, (priority[s], s))
    return out


def _topological(units: list[_Unit]) -> list[int]:
    out = _ordered_by({v: set(u.preds + u.after) for v, u in enumerate(units)},
                      {v: u.pos for v, u in enumerate(units)})
    if len(out) != len(units):
        raise ValueError(f"predict_kernels: dependency cycle through {len(units) - len(out)} nodes")
    return out


def _kernel_name(nodes: list[DagNode], units: list[_Unit], succs: list[list[int]], members: list[int]) -> str:
    """A predicted kernel's name: its first FX member's (a concatenation's copy of a graph input: after the
    concatenation and the input's place in it)."""
    first = min(members, key=lambda v: units[v].pos)
    fx_members = [i for v in sorted(members, key=lambda v: units[v].pos) for i in units[v].members]
    if fx_members:
        return nodes[fx_members[0]].name
    cat = next(s for s in succs[first] if units[s].kind is _NOP)
    return f"{nodes[units[cat].members[0]].name}_copy{units[cat].preds.index(first)}"


def _contract(dag: Dag, units: list[_Unit], succs: list[list[int]], groups: _Groups,
              group_members: dict[int, list[int]], inlined: set[int]) -> Dag:
    nodes = dag.nodes
    graph_inputs = {name: nbytes for node in nodes for name, nbytes in node.input_reads.items()}
    roots = sorted(group_members, key=lambda r: min(units[v].pos for v in group_members[r]))
    kernel_preds: dict[int, set[int]] = {}
    kernel_after: dict[int, set[int]] = {}
    for r in roots:
        kernel_preds[r] = {groups.find(p) for v in group_members[r] for p in units[v].preds} - {r}
        kernel_after[r] = ({groups.find(p) for v in group_members[r] for p in units[v].after} - {r}) | kernel_preds[r]
    # order: the kernels topologically, the earliest first member first
    first = {r: min(units[v].pos for v in group_members[r]) for r in roots}
    order = _ordered_by(kernel_after, first)
    if len(order) != len(roots):
        raise ValueError("predict_kernels: the predicted kernels depend on each other in a cycle")
    new_id = {r: k for k, r in enumerate(order)}
    kernel_name = {r: _kernel_name(nodes, units, succs, group_members[r]) for r in order}

    # per unit, the units reading one of its results (a fallback kernel's: key (unit, k)) and which
    result_readers: dict[int, list[tuple[int, Any]]] = {}
    for w, unit in enumerate(units):
        for src_unit, key, _, _ in unit.reads:
            if isinstance(key, tuple):
                result_readers.setdefault(src_unit, []).append((w, key))

    out_nodes: list[DagNode] = []
    for r in order:
        members = sorted(group_members[r], key=lambda v: units[v].pos)
        head = units[members[0]]
        if head.kind in (_COMM, _EXTERN) and len(members) == 1 and head.members:
            src = nodes[head.members[0]]
            node = DagNode(**{k: getattr(src, k) for k in src.__dataclass_fields__})
            node.input_reads = dict(src.input_reads)
            if head.in_place_of is not None:  # its result lives in its input's buffer
                node.out_bytes = 0
            node.is_output = head.graph_output and head.in_place_of is None
            node.graph_output_bytes = node.out_bytes if node.is_output else 0
            results = src.origin.meta.get("val") if isinstance(src.origin, fx.Node) else None
            if isinstance(results, (list, tuple)) and head.kind is _EXTERN and not node.is_output:
                # a fallback kernel's results: each its own buffer, freed after its own readers; one nobody
                # reads is never unpacked, and Inductor's estimate does not count it
                readers_of: dict[int, set[str]] = {}
                for w, key in result_readers.get(members[0], ()):
                    g = groups.find(w)
                    if g != r:
                        readers_of.setdefault(key[1], set()).add(kernel_name[g])
                node.output_buffers = tuple(OutputBuffer(_bytes(results[k]), tuple(sorted(readers_of[k])))
                                            for k in sorted(readers_of))
                node.out_bytes = sum(b.nbytes for b in node.output_buffers)
            node.alias_of = None
            node.collective_of = None
            out_nodes.append(node)
            continue
        if head.kind is _NOP:
            src = nodes[head.members[0]]
            out_nodes.append(DagNode(name=src.name, kind=NodeKind.COMPUTE, op=src.op, out_bytes=head.out_bytes,
                                     dtype=src.dtype, module_fqn=src.module_fqn, origin=src.origin,
                                     is_output=head.graph_output, launches_kernel=False))
            continue
        fx_members = [i for v in members for i in units[v].members]
        read: dict[Any, int] = {}
        cap: dict[Any, int] = {}
        input_reads: dict[str, int] = {}
        for v in members:
            for src_unit, key, nbytes, whole in units[v].reads:
                if src_unit is not None and groups.find(src_unit) == r:
                    continue  # produced inside the kernel
                read[key] = read.get(key, 0) + nbytes
                cap[key] = whole
                if src_unit is None and key in graph_inputs:
                    input_reads[key] = graph_inputs[key]
        in_bytes = sum(min(b, cap[k]) for k, b in read.items())
        out_bytes = 0
        written = 0
        graph_output_bytes = 0
        buffers: list[OutputBuffer] = []
        internal = 0
        read_in_place = False
        for v in members:
            u = units[v]
            readers = {groups.find(s) for s in succs[v]} - {r}
            returned = u.graph_output
            for s in succs[v]:
                if units[s].in_place_of == v:  # a scatter into this buffer: its readers read the buffer
                    readers |= {groups.find(t) for t in succs[s]} - {r}
                    returned = returned or units[s].graph_output
                    read_in_place = True
            if u.in_place_of is not None:  # a scatter writing into another kernel's buffer: counted there
                continue
            if u.writes_into:  # into its slice of a concatenation's buffer, read by the concatenation
                written += u.writes_into
                buffers.append(OutputBuffer(u.writes_into, tuple(sorted(kernel_name[g] for g in readers)),
                                            allocated=False))
                continue
            if u.members and (readers or returned):
                out_bytes += u.out_bytes
                graph_output_bytes += u.out_bytes if u.graph_output else 0
                copy_for = {g for g in readers if _reads_as_addmm(units[g], nodes)} if u.output_copy else set()
                if copy_for:  # addmm's copy of its input and the returned one
                    out_bytes += u.out_bytes
                    buffers.append(OutputBuffer(u.out_bytes, tuple(sorted(kernel_name[g] for g in copy_for))))
                    readers -= copy_for
                buffers.append(OutputBuffer(u.out_bytes, tuple(sorted(kernel_name[g] for g in readers)),
                                            graph_output=returned))
            elif u.members and v not in inlined and u.out_bytes:
                # realised, read only inside the kernel: no memory holds it, Inductor's estimate counts it
                internal += u.out_bytes
                buffers.append(OutputBuffer(u.out_bytes, (), allocated=False))
        is_output = any(units[v].members and units[v].graph_output and units[v].in_place_of is None for v in members)
        name = kernel_name[r]
        if fx_members:
            src = nodes[fx_members[0]]
        else:  # a concatenation's copy of a graph input
            src = nodes[units[next(s for s in succs[members[0]] if units[s].kind is _NOP)].members[0]]
        fqn, origin = src.module_fqn, src.origin
        ops = []
        for i in fx_members:
            b = _base_op(nodes[i])[1]
            if b not in ops:
                ops.append(b)
        label = ",".join(ops[:4]) + (",..." if len(ops) > 4 else "")
        out_nodes.append(DagNode(
            name=name, kind=NodeKind.COMPUTE, op=f"kernel[{label or 'copy'}]",
            in_bytes=in_bytes + written, out_bytes=out_bytes, non_owning_bytes=written + internal,
            graph_output_bytes=graph_output_bytes,
            dtype=next((nodes[i].dtype for i in fx_members if nodes[i].dtype), src.dtype),
            flops=sum(nodes[i].flops for i in fx_members), is_output=is_output, module_fqn=fqn, origin=origin,
            input_reads=input_reads,
            output_buffers=tuple(buffers) if len(buffers) > 1 or read_in_place or internal else (),
        ))
    # collectives and waits: re-point the wait at its collective's new id; the wait aliases it
    fx_to_new: dict[int, int] = {}
    for r in order:
        for v in group_members[r]:
            for i in units[v].members:
                fx_to_new[i] = new_id[r]
    for k, node in enumerate(out_nodes):
        if node.kind is NodeKind.WAIT:
            src = nodes[units[order[k]].members[0]]
            if src.collective_of is not None and src.collective_of in fx_to_new:
                node.collective_of = fx_to_new[src.collective_of]
                node.alias_of = node.collective_of
    edges = [(new_id[p], new_id[r]) for r in order for p in kernel_preds[r]]
    return Dag(out_nodes, edges, dag.resident_bytes)
