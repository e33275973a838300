"""Inductor scheduler nodes -> the neutral DAG.

Dependencies come from each node's reads (``read_writes.reads``) resolved to the node that produced the
buffer (mutations included: a wait's output mutates its collective's buffer).  Inductor's *fake* ``WeakDep``s,
which chain every collective to the previous one (``comms.decide_global_ordering_of_comms``), are dropped:
the DAG keeps the per-process-group issue order as a constraint instead, so several collectives may be in
flight at once without any rank changing its collective sequence.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch._inductor import config as inductor_config, dependencies, ir
from torch._inductor.fx_passes.control_dependencies import control_deps
from torch._inductor.scheduler import BaseSchedulerNode, NopKernelSchedulerNode
from torch._inductor.utils import get_dtype_size, get_fused_kernel_name, is_collective, is_wait
from torch._inductor.virtualized import V
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..dag.flops import has_flop_formula
from ..dag.from_fx import UnplannableGraph, fx_node_flops
from ..dag.graph import CollectiveOp, Dag, DagNode, NodeKind, OutputBuffer
from ..dag.ops import FLOAT8_SCALING_OPS, PASS_THROUGH_OPS, classify, fill_collective, mark_fsdp


def _size_hint(expr: Any) -> int:
    if isinstance(expr, int):
        return expr
    if getattr(expr, "is_number", False):  # a sympy constant: no graph needed
        return int(expr)

    if free_unbacked_symbols(expr):
        # a data-dependent size: any number would be a guess, and a memory budget over guesses means nothing
        raise UnplannableGraph(f"size {expr} is unbacked (data-dependent)")

    return int(V.graph.sizevars.optimization_hint(expr, fallback=0))


def _layout_bytes(ir_node: Any) -> int:
    """Bytes of an IR buffer's layout; 0 for layouts that allocate nothing (NoneLayout, mutation outputs)."""
    layout = getattr(ir_node, "layout", None)
    size = getattr(layout, "size", None)
    dtype = getattr(layout, "dtype", None)
    if size is None or dtype is None or not isinstance(dtype, torch.dtype):
        return 0
    return _numel(size) * dtype.itemsize


def _numel(size: Sequence[Any]) -> int:
    """Elements of a (size-hinted) shape."""
    numel = 1
    for s in size:
        numel *= _size_hint(s)
    return numel


def _allocated_bytes(ir_node: Any) -> int:
    """Bytes a buffer allocates: 0 for one laid out inside another buffer (a concatenation's input written
    into its slice of the result: ``NonOwningLayout``)."""
    if isinstance(getattr(ir_node, "layout", None), ir.NonOwningLayout):
        return 0
    return _layout_bytes(ir_node)


def _launches_kernel(snode: Any) -> bool:
    """False for scheduler nodes that generate no kernel: a ``NopKernelSchedulerNode`` (a concatenation
    whose inputs were written into its buffer) and the ``MultiOutput`` unpacking of a fallback kernel's
    results."""
    return not (isinstance(snode, NopKernelSchedulerNode) or isinstance(getattr(snode, "node", None), ir.MultiOutput))


def _dtype_name(ir_node: Any) -> str | None:
    dtype = getattr(getattr(ir_node, "layout", None), "dtype", None)
    return str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else None


def _op_name(snode: Any) -> str:
    node = getattr(snode, "node", None)
    overload = getattr(node, "op_overload", None)
    if isinstance(overload, torch._ops.OpOverload):
        return f"{overload.namespace}.{overload._opname}.{overload._overloadname}"
    kernel = getattr(node, "python_kernel_name", None)
    if kernel:
        return str(kernel)
    # a generated (possibly fused) kernel: name it after the aten ops it computes, as a reader would
    ops: list[str] = []
    for part in getattr(snode, "snodes", None) or [snode]:
        for origin in sorted(getattr(getattr(part, "node", None), "origins", ()) or (), key=lambda n: n.name):
            target = getattr(origin, "target", None)
            base = getattr(target, "_opname", None) or getattr(target, "__name__", None)
            if origin.op == "call_function" and base and base not in ops:
                ops.append(base)
    if ops:
        shown = ",".join(ops[:4]) + (",..." if len(ops) > 4 else "")
        return f"kernel[{shown}]"
    return type(snode).__name__


def _kernel_key(snode: Any) -> str | None:
    """What a measured kernel time of this node is looked up by (``DagNode.kernel_key``).

    A generated kernel: the name stem Inductor gives it at code generation ("fused_relu_sum" of
    "cpp_fused_relu_sum_3" / "triton_poi_fused_relu_sum_3"), from the same naming function.  An extern
    kernel: "<aten op> <shapes>" (``aten.mm float32[2,64];...``) with its inputs' (and out-variant output's) shapes, as ``calibrate_from_trace`` keys the aten op events
    of a profiled step.
    """
    node = getattr(snode, "node", None)
    overload = getattr(node, "op_overload", None)
    if isinstance(overload, torch._ops.OpOverload):
        # an out-variant extern (extern_kernels.mm(a, b, out=buf)) shows its output among its inputs
        tensors = list(getattr(node, "inputs", ()) or ()) + ([node] if isinstance(node, ir.ExternKernelOut) else [])
        shapes = []
        for inp in tensors:
            layout = getattr(inp, "layout", None)
            size, dtype = getattr(layout, "size", None), getattr(layout, "dtype", None)
            if size is None or not isinstance(dtype, torch.dtype):
                continue
            try:
                dims = ",".join(str(_size_hint(d)) for d in size)
            except Exception:  # an unhinted size: no key, the roofline prices the node
                return None
            shapes.append(f"{str(dtype).replace('torch.', '')}[{dims}]")
        # the profiler names the op packet (aten::mm), not the overload (mm.out)
        return f"{overload.namespace}.{overload._opname} {';'.join(shapes)}"
    try:
        if snode.is_extern():
            return None  # an extern kernel without an aten overload: nothing to match it by
        device = snode.get_device()
        descriptive = (inductor_config.cpp.descriptive_names if getattr(device, "type", "cpu") == "cpu"
                       else inductor_config.triton.descriptive_names)
        name = get_fused_kernel_name(snode.get_nodes(), descriptive)
    except Exception:  # origins without metadata: no name to match
        return None
    return name if name != "fused" else None


def _wrapped_ops(origin: Any) -> list[Any]:
    """The FX ops an origin node stands for: itself, or, for Inductor's ``control_deps`` wrapper (which the
    OverlapScheduler puts around a kernel to pin its order), the call(s) inside the wrapper's subgraph,
    recursively.  The wrapper's lowering gives its result buffer the wrapper as origin, so without this the
    kernel under it would have no FLOP formula and no op name."""
    if getattr(origin, "target", None) is not control_deps:
        return [origin]
    subgraph = origin.args[1] if len(origin.args) > 1 else None
    if isinstance(subgraph, torch.fx.Node) and subgraph.op == "get_attr":
        module: Any = origin.graph.owning_module
        try:
            for part in str(subgraph.target).split("."):
                module = getattr(module, part)
        except AttributeError:  # the subgraph is gone: nothing to see through
            return [origin]
        subgraph = module
    if not isinstance(subgraph, torch.fx.GraphModule):
        return [origin]
    return [op for node in subgraph.graph.nodes if node.op == "call_function" for op in _wrapped_ops(node)]


def _origin_flops(snode: Any) -> float:
    """FLOPs of one (unfused) scheduler node's origin op, see ``_flops``."""
    origin = None
    try:
        origin = snode.node.get_origin_node()
    except Exception:  # generated nodes may have no single origin
        pass
    if origin is None:
        # a fallback kernel with several results (attention) has its getitems among its origins too: its op is
        # the origin that calls the kernel's overload
        overload = getattr(getattr(snode, "node", None), "op_overload", None)
        if overload is not None:
            origin = next((o for o in getattr(snode.node, "origins", ()) if o.target is overload), None)
    if origin is None:
        return 0.0
    ops = _wrapped_ops(origin)
    if all(has_flop_formula(op.target) for op in ops):
        try:
            return float(sum(fx_node_flops(op) for op in ops))
        except Exception:  # fall back to Inductor's count below
            pass
    try:
        return float(snode.estimate_flops() or 0)
    except Exception:  # needs V.graph to resolve symbolic counts; bytes still give a roofline estimate
        return 0.0


def _flops(snode: Any) -> float:
    """FLOPs of the node's origin op(s) from the flop formulas on their (size-hinted) shapes, as the FX DAG
    counts them; Inductor's own count (which dispatches the op on fake tensors, ~4 ms a node) only as a
    fallback.  A fused or grouped node counts every node it is made of (a matmul template with a fused
    epilogue keeps its matmul), a node under ``control_deps`` the op the wrapper holds."""
    parts = getattr(snode, "snodes", None) or [snode]
    return float(sum(_origin_flops(part) for part in parts))


def dag_from_scheduler_nodes(snodes: Sequence[BaseSchedulerNode], graph_outputs: set[str] | None = None,
                             kernel_keys: bool = True) -> Dag:
    """One DagNode per scheduler node (fused nodes stay one node), in the given order.

    kernel_keys: fill ``DagNode.kernel_key`` (what a calibration's kernel times and the DAG dump read; a
    pass with neither skips it, about a tenth of the adapter's time)."""
    producer: dict[str, int] = {}
    readers: dict[str, set[int]] = {}  # buffer name -> the nodes reading it
    renamed_from: dict[str, str] = {}  # a mutated buffer's new name -> the buffer it names
    nodes: list[DagNode] = []
    edges: list[tuple[int, int]] = []
    outputs = graph_outputs if graph_outputs is not None else _graph_output_names()
    graph_inputs = _graph_input_names()
    covered_numel: dict[tuple, int | None] = {}  # see _covered_elements
    for i, snode in enumerate(snodes):
        ir_node = getattr(snode, "node", None)
        name = _op_name(snode)
        if ir_node is not None and is_collective(ir_node):
            kind, op = classify(name)
            if kind is not NodeKind.COLLECTIVE:
                kind, op = NodeKind.COLLECTIVE, CollectiveOp.OTHER
        elif ir_node is not None and is_wait(ir_node):
            kind, op = NodeKind.WAIT, None
        else:
            kind, op = NodeKind.COMPUTE, None
        buffers = list(snode.get_outputs())
        if kind is NodeKind.COMPUTE:
            # a kernel writing into a buffer another node allocated (an index_put_ accumulating into zeros)
            # gives it a new name, no new memory; who reads the new name keeps the buffer alive
            for b in buffers:
                for m in b.get_mutations():
                    renamed_from[b.get_name()] = renamed_from.get(m, m)
        owned = [b for b in buffers if b.get_name() not in renamed_from]
        out_bytes = sum(_allocated_bytes(b.node) for b in owned)
        node = DagNode(name=snode.get_name(), kind=kind, op=name, collective=op, out_bytes=out_bytes,
                       dtype=_dtype_name(buffers[0].node) if buffers else None, origin=snode,
                       launches_kernel=_launches_kernel(snode),
                       non_owning_bytes=sum(_layout_bytes(b.node) for b in owned) - out_bytes)
        deps = set()
        for dep in snode.read_writes.reads:
            if getattr(dep, "is_fake", False):
                continue  # Inductor's collective chain: replaced by the per-group order constraint
            if dep.name in graph_inputs:
                node.input_reads[dep.name] = _dep_bytes(dep)
            src = producer.get(dep.name)
            if src is not None and src != i:
                deps.add(src)
                readers.setdefault(dep.name, set()).add(i)
        for dep in getattr(snode, "unmet_dependencies", ()):
            if getattr(dep, "is_fake", False):
                continue
            src = producer.get(dep.name)
            if src is not None and src != i:
                deps.add(src)
                readers.setdefault(dep.name, set()).add(i)
        edges.extend((src, i) for src in sorted(deps))
        if kind is NodeKind.COLLECTIVE:
            inputs = [t for t in getattr(ir_node, "inputs", ()) if hasattr(t, "layout")]
            payload_in = _layout_bytes(inputs[0]) if inputs else 0
            payload_out = out_bytes
            if not payload_out and len(inputs) > 1:
                # an out-variant (e.g. all_gather_into_tensor_out, as Inductor's own bucketing emits) writes
                # into its last input instead of allocating an output
                payload_out = _layout_bytes(inputs[-1])
            fill_collective(node, op, getattr(ir_node, "constant_args", ()) or (), payload_in, payload_out)
        elif kind is NodeKind.WAIT:
            mutated = [m for b in buffers for m in b.get_mutations()]
            target = next((producer[m] for m in mutated if m in producer), None)
            if target is not None and nodes[target].kind is NodeKind.COLLECTIVE:
                node.collective_of = target
                node.alias_of = target
                node.group_name = nodes[target].group_name
        else:
            node.flops = _flops(snode)
            if kernel_keys:
                node.kernel_key = _kernel_key(snode)
            try:
                total = _accessed_bytes(snode, covered_numel)
            except Exception:
                total = out_bytes
            node.in_bytes = max(total - out_bytes, 0)
        if node.dtype is None:
            # in-place collectives (all_reduce_) and fallback kernels with several results (attention) own no
            # typed buffer: they compute in their first input's dtype (the FX DAG reads it off the first result)
            node.dtype = next(filter(None, map(_dtype_name, getattr(ir_node, "inputs", ()) or ())), None)
        # an in-place collective (all_reduce_) or a wait writes a buffer it does not own: a graph output too
        returned = [b for b in buffers if b.get_name() in outputs or any(m in outputs for m in b.get_mutations())]
        if returned:
            node.is_output = True
            node.graph_output_bytes = sum(_allocated_bytes(b.node) for b in returned)
        for b in buffers:
            producer[b.get_name()] = i
        nodes.append(node)
    renamed_returned = set()
    for new, real in renamed_from.items():  # the readers of a new name read the buffer it names
        readers.setdefault(real, set()).update(readers.get(new, ()), [producer[new]])
        if new in outputs:
            renamed_returned.add(real)
    for node, snode in zip(nodes, snodes):
        buffers = [b for b in snode.get_outputs() if b.get_name() not in renamed_from]
        if len(buffers) > 1 or any(b.get_name() in renamed_returned or b.get_name() in renamed_from.values()
                                   for b in buffers):
            node.output_buffers = _output_buffers(snode, buffers, readers, nodes, outputs | renamed_returned)
            # a buffer computed inside its kernel is neither allocated nor written to memory
            node.out_bytes = sum(b.nbytes for b in node.output_buffers if b.allocated)
            node.non_owning_bytes = sum(b.nbytes for b in node.output_buffers if not b.allocated)
    _mark_kernel_groups(snodes, nodes)
    dag = Dag(nodes, edges, _graph_input_bytes())
    # FSDP-like by the same rule as the FX view; a (fused) kernel passes values through when every op it
    # was made from does.  Worked out when asked: mark_fsdp asks only about nodes next to collectives, and
    # reading a node's origin ops is most of what a flag costs
    @functools.cache
    def passes_through(i: int) -> bool:
        return nodes[i].kind is NodeKind.COMPUTE and _passes_through(snodes[i])

    @functools.cache
    def scales(i: int) -> bool:
        return nodes[i].kind is NodeKind.COMPUTE and _passes_through(snodes[i], FLOAT8_SCALING_OPS)

    mark_fsdp(dag, passes_through, scaling=scales)
    return dag


def _writes_shared_kernel(snode: Any) -> bool:
    """Whether Inductor's code generation adds ``snode`` to the kernel it is writing instead of closing it:
    the C++ backend writes consecutive compute nodes as one function and closes it at an extern kernel
    (a collective, a wait, a library call) or a template; the GPU backends write a kernel per node."""
    if snode.is_extern() or snode.is_template():
        return False
    device = snode.get_device()
    return device is not None and device.type == "cpu" and inductor_config.cpu_backend == "cpp"


def _mark_kernel_groups(snodes: Sequence[BaseSchedulerNode], nodes: list[DagNode]) -> None:
    """Number the runs of consecutive nodes emitted as one kernel in the given order (``DagNode.kernel_group``);
    a node generating no code (a concatenation's ``NopKernel``) neither closes a run nor counts in it."""
    run: list[int] = []
    groups = 0

    def close() -> None:
        nonlocal groups
        if sum(nodes[i].launches_kernel for i in run) > 1:
            for i in run:
                nodes[i].kernel_group = groups
            groups += 1
        run.clear()

    for i, snode in enumerate(snodes):
        if isinstance(snode, NopKernelSchedulerNode):
            if run:
                run.append(i)
        elif _writes_shared_kernel(snode):
            run.append(i)
        else:
            close()
    close()


def _output_buffers(snode: Any, buffers: list[Any], readers: dict[str, set[int]], nodes: list[DagNode],
                    outputs: set[str]) -> tuple[OutputBuffer, ...]:
    """Each buffer of a node writing several, with the nodes that read it.  A buffer of a fused kernel that
    no other node reads and the graph does not return is computed inside the kernel: Inductor's memory
    planning counts it, no memory holds it (code generation removes it)."""
    fused = len(snode.get_nodes()) > 1
    out = []
    for b in buffers:
        name = b.get_name()
        returned = name in outputs or any(m in outputs for m in b.get_mutations())
        read_by = tuple(nodes[j].name for j in sorted(readers.get(name, ())))
        allocated = _allocated_bytes(b.node)
        local = fused and not read_by and not returned
        out.append(OutputBuffer(nbytes=_layout_bytes(b.node), readers=read_by, graph_output=returned,
                                allocated=bool(allocated) and not local))
    return tuple(out)


def _origin_ops(snode: Any) -> list[str]:
    """Base names of the FX ops a scheduler node (every part of a fused one) was made from."""
    ops = []
    for part in getattr(snode, "snodes", None) or [snode]:
        for origin in getattr(getattr(part, "node", None), "origins", ()) or ():
            if origin.op != "call_function":
                continue
            for op in _wrapped_ops(origin):
                target = getattr(op, "target", None)
                ops.append(getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target))
    return ops


def _passes_through(snode: Any, also: frozenset = frozenset()) -> bool:
    # a collective among the origins: the kernel that copies a collective's input into its buffer
    ops = _origin_ops(snode)
    return bool(ops) and all(op in PASS_THROUGH_OPS or op in also or classify(op)[0] is NodeKind.COLLECTIVE
                             for op in ops)


def _graph_input_bytes() -> int:
    try:
        return sum(_layout_bytes(getattr(t, "data", t)) if not hasattr(t, "layout") else _layout_bytes(t)
                   for t in V.graph.graph_inputs.values())
    except Exception:  # outside a graph lowering: no inputs known
        return 0


def _graph_input_names() -> set[str]:
    try:
        return set(V.graph.graph_inputs)
    except Exception:  # outside a graph lowering (e.g. a unit test on hand-made nodes)
        return set()


def _dep_bytes(dep: Any) -> int:
    """Bytes a dependency reads of its buffer, as Inductor's memory planning sizes it."""
    try:
        return int(V.graph.get_dep_size_hint(dep))
    except Exception:  # an unhinted size: the input's memory is unknown
        return 0


def _covered_elements(snode: Any, numel_of: dict[tuple, int | None]) -> dict[str, int | None]:
    """Per buffer, how many of its elements the node's accesses cover (None: all of it).

    A loop kernel's access covers the loop variables its index uses (``MemoryDep.get_numel``); an extern
    kernel's, the size of each input as passed (a view of a bucket is its slice, not the bucket).
    ``numel_of`` caches a loop access's count by its index and loop (every block repeats them)."""
    covered: dict[str, int | None] = {}

    def add(name: str, elements: int | None) -> None:
        if name in covered and (covered[name] is None or elements is None):
            covered[name] = None
        else:
            covered[name] = covered.get(name, 0) + elements if elements is not None else None

    for part in getattr(snode, "snodes", None) or [snode]:
        ir_node = getattr(part, "node", None)
        if isinstance(ir_node, ir.ExternKernel):
            inputs = [x for i in ir_node.inputs for x in (i if isinstance(i, (list, tuple)) else [i])]
            for x in inputs:
                if hasattr(x, "get_name") and hasattr(x, "get_size"):
                    add(x.get_name(), _numel(x.get_size()))
            for dep in part.read_writes.writes:
                add(dep.name, None)
            continue
        for dep in (*part.read_writes.reads, *part.read_writes.writes):
            if isinstance(dep, dependencies.MemoryDep):
                key = (dep.index, dep.var_names, dep.size)
                if key not in numel_of:
                    numel_of[key] = None if dep.is_indirect() else _size_hint(dep.get_numel())
                add(dep.name, numel_of[key])
            elif not getattr(dep, "is_fake", False):
                add(dep.name, None)
    return covered


def _accessed_bytes(snode: Any, numel_of: dict[tuple, int | None]) -> int:
    """Bytes a kernel reads and writes: Inductor's count per buffer, capped at what the accesses cover.

    Inductor charges each access the whole loop's size (an extern or fused kernel's: any size), at most the
    buffer: a norm or matmul reading its weight's slice of a merged bucket is charged the whole bucket, which
    an unmerged compile does not pay."""
    per_buffer = snode.get_read_write_buffer_accesses(include_reads=True, include_writes=True)
    covered = _covered_elements(snode, numel_of)
    total = 0
    for name, nbytes in per_buffer.items():
        elements = covered.get(name)
        buf = V.graph.name_to_buffer.get(name) or V.graph.graph_inputs.get(name)
        try:
            # a buffer with no layout of its own (a wait's result) is the buffer it mutates
            mutated = buf.get_mutation_names() if isinstance(getattr(buf, "layout", None), ir.NoneLayout) else ()
            dtype = (V.graph.get_buffer(mutated[0]) if mutated else buf).get_dtype()
        except Exception:  # not a tensor buffer (a TorchBind object): Inductor's count stands
            dtype = None
        if elements is not None and isinstance(dtype, torch.dtype):
            nbytes = min(nbytes, elements * get_dtype_size(dtype))
        total += nbytes
    return int(total)


def _graph_output_names() -> set[str]:
    try:
        return set(V.graph.get_output_names())
    except Exception:  # outside a graph lowering (e.g. a unit test on hand-made nodes)
        return set()
