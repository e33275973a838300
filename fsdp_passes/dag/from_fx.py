"""Build the DAG from a post-grad FX graph (what Inductor's post-grad custom passes receive)."""

from __future__ import annotations

import functools
import operator
import re
from typing import Any, Iterable

import torch
import torch.fx as fx

from .collectives import KINDS
from .flops import aten_flops, has_flop_formula
from .graph import Dag, DagNode, NodeKind
from .ops import FLOAT8_SCALING_OPS, PASS_THROUGH_OPS, as_int, classify, fill_collective, mark_fsdp, op_base_name


class UnplannableGraph(ValueError):
    """The graph cannot be planned (e.g. unbacked symbolic sizes); the passes leave it untouched."""


# what an all-gather's input may go through from the parameter shard (``ops.mark_fsdp`` has the rule)
_PASS_THROUGH = PASS_THROUGH_OPS


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) tuple/list; 0 for non-tensors."""
    if isinstance(value, torch.Tensor):
        return as_int(value.numel()) * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def _dtype_of(value: Any) -> str | None:
    if isinstance(value, torch.Tensor):
        return str(value.dtype).replace("torch.", "")
    if isinstance(value, (list, tuple)):
        for v in value:
            d = _dtype_of(v)
            if d is not None:
                return d
    return None


def op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _base(node: fx.Node) -> str:
    if node.target is operator.getitem:
        return "getitem"
    return op_base_name(op_name(node))[1]


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return bool(target.is_view)
    return node.target is operator.getitem


def _mutated_args(node: fx.Node) -> list[fx.Node]:
    target = node.target
    # most ops write nothing: the schema's flag is cheap, building its argument list is not
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                out.append(value)
    return out


_MODULE_PATH_RE = re.compile(r"\[(?:'([^']*)'|(\d+))\]")
# the variable a Dynamo source starts from: L['self'] / L.self (a compiled module), G['model'] (a global)
_ROOT_RE = re.compile(r"^(?:L|G)\.[A-Za-z_][A-Za-z0-9_]*(?:\.|$)")
# Dynamo's source of a module reached through a property's closure (a parametrization frontend):
# dict(type(<module>).__dict__)['weight'].fget.__closure__[0].cell_contents
_CLOSURE_RE = re.compile(r"^dict\(type\((?P<module>.*)\)\.__dict__\)\.(?P<attr>[A-Za-z_][A-Za-z0-9_]*)\.fget\b")


@functools.lru_cache(maxsize=8192)  # a pure function of the text; every node of a block repeats its path
def normalize_module_path(path: str) -> str:
    """A module or parameter path as Dynamo writes it -> its FQN in the compiled module's naming.

    ``L['self'].layers[0].attn`` / ``L['self']._modules['layers']._modules['0']._parameters['weight']`` /
    ``L__self___layers_0`` / ``G['model'].norm`` -> ``layers.0.attn`` / ``layers.0.weight`` / ``layers.0`` /
    ``norm``: the root variable (the compiled module, or the global or argument holding the model) is dropped.
    """
    text = _MODULE_PATH_RE.sub(lambda m: "." + (m.group(1) if m.group(1) is not None else m.group(2)), path)
    text = _ROOT_RE.sub("", text, count=1)
    for prefix in ("self.", "L__self__."):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    text = text.lstrip(".")
    if text.startswith("L__self___"):
        text = text[len("L__self___") :].replace("_", ".")
    for container in ("_modules", "_parameters", "_buffers", "_orig_mod"):
        text = text.replace(f".{container}.", ".")
        if text.startswith(container + "."):
            text = text[len(container) + 1 :]
    return text


def closure_attribute(path: str) -> str | None:
    """The attribute whose property getter a closure source goes through (``'weight'`` for
    ``dict(type(...).__dict__)['weight'].fget.__closure__[0].cell_contents``), else None."""
    text = _MODULE_PATH_RE.sub(lambda m: "." + (m.group(1) if m.group(1) is not None else m.group(2)), path)
    m = _CLOSURE_RE.match(text)
    return m.group("attr") if m else None


#: ``node.meta["custom"]`` key torchtitan's ``annotate_module_fqns`` writes the running module's FQN under
ANNOTATED_MODULE_KEY = "module_fqn"


def module_fqn(node: fx.Node) -> str | None:
    """The innermost module that produced ``node`` (forward or, via autograd meta, backward).

    An annotated module FQN (``meta["custom"]["module_fqn"]``) wins.  Otherwise the innermost entry of
    ``nn_module_stack`` (``fwd_nn_module_stack`` in backward) that names a module by attribute path: entries
    reached through a property's closure (a parametrization object, which the frontend may even share between
    modules of one class) are skipped, so the module whose forward read the parameter is the answer.
    """
    custom = node.meta.get("custom")
    if isinstance(custom, dict) and isinstance(custom.get(ANNOTATED_MODULE_KEY), str):
        return custom[ANNOTATED_MODULE_KEY]
    for key in ("nn_module_stack", "fwd_nn_module_stack"):
        stack = node.meta.get(key)
        if stack:
            for entry in reversed(list(stack.values())):
                path = entry[0] if isinstance(entry, tuple) else str(entry)
                if "(" in path:  # a closure / __dict__ source, not an attribute path
                    continue
                return normalize_module_path(path)
    return None


def stack_parameter(node: fx.Node) -> str | None:
    """The parameter a node reads through a property getter (a parametrization frontend), from its module
    stack alone: the module whose forward read it plus the property's name (``norm`` + ``weight``)."""
    for key in ("nn_module_stack", "fwd_nn_module_stack"):
        stack = node.meta.get(key)
        if not stack:
            continue
        entries = [e[0] if isinstance(e, tuple) else str(e) for e in stack.values()]
        for k in range(len(entries) - 1, 0, -1):
            attr = closure_attribute(entries[k])
            if attr is None:
                continue
            owner = next((p for p in reversed(entries[:k]) if "(" not in p), None)
            if owner is not None:
                module = normalize_module_path(owner)
                return f"{module}.{attr}" if module else attr
        return None
    return None


def _walk_pass_through(start: fx.Node) -> Iterable[fx.Node]:
    """Nodes reachable from ``start`` backwards through dtype casts and views."""
    stack, seen = [start], {start}
    while stack:
        node = stack.pop()
        yield node
        for nxt in node.all_input_nodes:
            if nxt in seen:
                continue
            if nxt.op == "placeholder" or (nxt.op == "call_function" and _base(nxt) in _PASS_THROUGH):
                seen.add(nxt)
                stack.append(nxt)


def _gathered_placeholder(node: fx.Node) -> str | None:
    """The placeholder (parameter shard) an all-gather gathers, perhaps through casts and views."""
    source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if source is None:
        return None
    for n in _walk_pass_through(source):
        if n.op == "placeholder":
            return str(n.target)
    return None


def dag_from_fx(graph: fx.Graph | fx.GraphModule) -> Dag:
    """One DagNode per call_function node, in graph order; placeholders and outputs are not nodes."""
    if isinstance(graph, fx.GraphModule):
        graph = graph.graph
    nodes: list[DagNode] = []
    edges: list[tuple[int, int]] = []
    index: dict[fx.Node, int] = {}
    root: dict[fx.Node, Any] = {}  # fx node -> the buffer it lives in (an fx node); views share their base's
    last_writer: dict[Any, int] = {}
    readers: dict[Any, list[int]] = {}
    output_roots: set[Any] = set()
    resident = 0
    size_of: dict[fx.Node, int] = {}  # tensor_bytes of each value read so far: an input's, counted again per reader

    def bytes_of(a: fx.Node) -> int:
        b = size_of.get(a)
        if b is None:
            b = size_of[a] = tensor_bytes(a.meta.get("val"))
        return b

    for fx_node in graph.nodes:
        if fx_node.op == "placeholder" or fx_node.op == "get_attr":
            root[fx_node] = fx_node
            try:
                resident += bytes_of(fx_node)
            except ValueError:  # an unbacked input size: the budget base just misses it
                pass
            continue
        if fx_node.op == "output":
            for arg in fx_node.all_input_nodes:
                output_roots.add(root.get(arg, arg))
            continue
        if fx_node.op != "call_function":
            raise UnplannableGraph(f"node {fx_node.name}: unsupported op kind {fx_node.op!r}")
        i = len(nodes)
        name = op_name(fx_node)
        kind, collective = classify(name)
        value = fx_node.meta.get("val")
        try:
            out_bytes = size_of[fx_node] = tensor_bytes(value)
            in_bytes = sum(map(bytes_of, fx_node.all_input_nodes))
        except ValueError as exc:
            raise UnplannableGraph(f"node {fx_node.name}: {exc}") from None
        node = DagNode(name=fx_node.name, kind=kind, op=name, collective=collective, in_bytes=in_bytes,
                       out_bytes=out_bytes, dtype=_dtype_of(value), origin=fx_node, module_fqn=module_fqn(fx_node))
        inputs = [a for a in fx_node.all_input_nodes]
        if kind is NodeKind.COLLECTIVE:
            const_args = [a for a in fx_node.args[1:] if not isinstance(a, fx.Node)]
            fill_collective(node, collective, const_args, in_bytes, out_bytes)
            if KINDS[collective].gathers:
                node.param_fqn = _gathered_placeholder(fx_node)
        elif kind is NodeKind.WAIT:
            producer = inputs[0] if inputs else None
            if producer in index and nodes[index[producer]].kind is NodeKind.COLLECTIVE:
                node.collective_of = index[producer]
                node.group_name = nodes[index[producer]].group_name
            node.alias_of = index.get(producer)
            node.out_bytes = 0
        elif _is_view(fx_node):
            base = inputs[0] if inputs else None
            node.alias_of = index.get(base)
            node.out_bytes = 0
        else:
            if has_flop_formula(fx_node.target):  # most nodes have none: skip building their arguments
                try:
                    node.flops = fx_node_flops(fx_node)
                except Exception:  # FLOPs are an estimate input; a node torch cannot count costs bytes only
                    node.flops = 0.0
        for arg in inputs:
            if arg in index:
                edges.append((index[arg], i))
            buf = root.get(arg, arg)
            if buf.op == "placeholder":  # a graph input, read directly or through views
                try:
                    node.input_reads[buf.name] = bytes_of(buf)
                except ValueError:  # an unbacked input size: its memory is unknown
                    node.input_reads[buf.name] = 0
        # buffer identity: views and waits live in their input's buffer
        if node.alias_of is not None or (_is_view(fx_node) and inputs):
            root[fx_node] = root.get(inputs[0], inputs[0])
        else:
            root[fx_node] = fx_node
        # mutation ordering: a write comes after earlier readers and writers of the buffer, later readers
        # and writers after it
        for arg in inputs:
            buf = root.get(arg, arg)
            if buf in last_writer and last_writer[buf] != i:
                edges.append((last_writer[buf], i))
            readers.setdefault(buf, []).append(i)
        for arg in _mutated_args(fx_node):
            buf = root.get(arg, arg)
            for r in readers.get(buf, []):
                if r != i:
                    edges.append((r, i))
            last_writer[buf] = i
            readers[buf] = []
        index[fx_node] = i
        nodes.append(node)

    for fx_node, i in index.items():
        if root.get(fx_node, fx_node) in output_roots and nodes[i].alias_of is None:
            nodes[i].is_output = True
            nodes[i].graph_output_bytes = nodes[i].out_bytes
    dag = Dag(nodes, edges, resident)
    pass_through = [n.kind is NodeKind.COMPUTE and op_base_name(n.op)[1] in PASS_THROUGH_OPS for n in nodes]
    mark_fsdp(dag, pass_through.__getitem__,
              sums=[n.kind is NodeKind.COMPUTE and op_base_name(n.op)[1] == "add" for n in nodes],
              scaling=lambda i: pass_through[i] or (nodes[i].kind is NodeKind.COMPUTE
                                                    and op_base_name(nodes[i].op)[1] in FLOAT8_SCALING_OPS))
    for node in nodes:
        if not node.fsdp:
            node.param_fqn = None
    return dag


def size_hinted(obj: Any) -> Any:
    """``obj`` with symbolic sizes replaced by their hints: tensors with a symbolic shape become meta tensors
    of the hinted shape, SymInts ints.  Counting FLOPs on these adds no guard to the compiled graph (on the
    symbolic values it would specialise dynamic dimensions).  Unbacked sizes raise ``ValueError``."""
    if isinstance(obj, torch.SymInt):
        return as_int(obj)
    if isinstance(obj, torch.Tensor):
        if all(isinstance(d, int) for d in obj.shape):
            return obj
        return torch.empty([as_int(d) for d in obj.shape], dtype=obj.dtype, device="meta")
    if isinstance(obj, (list, tuple)):
        return type(obj)(size_hinted(o) for o in obj)
    if isinstance(obj, dict):
        return {k: size_hinted(v) for k, v in obj.items()}
    return obj


#: ``fx.Node.meta`` key of a node's FLOP count, with the arguments it was counted on
_FLOPS_META = "fsdp_passes_flops"


def fx_node_flops(fx_node: fx.Node) -> float:
    """FLOPs of an FX node's op on its (size-hinted) argument and result values (``aten_flops``).  Kept in
    the node's meta with what it was counted on (op, argument tuples, result value, by identity): a graph's DAG
    is built more than once per compile (before and after bucketing, then from Inductor's scheduler nodes,
    whose origins are these nodes), and a node that was rewired, retargeted or given a new value since is
    counted again."""
    target, args, kwargs, value = fx_node.target, fx_node.args, fx_node.kwargs, fx_node.meta.get("val")
    cached = fx_node.meta.get(_FLOPS_META)
    if (cached is not None and cached[0] is target and cached[1] is args and cached[2] is kwargs
            and cached[3] is value):
        return cached[4]
    flops = aten_flops(target, size_hinted(fx_values(args)), size_hinted(fx_values(kwargs)), size_hinted(value))
    fx_node.meta[_FLOPS_META] = (target, args, kwargs, value, flops)
    return flops


def fx_values(obj: Any) -> Any:
    """``obj`` with every FX node replaced by its ``meta['val']`` (fake tensor), recursively."""
    if isinstance(obj, fx.Node):
        return obj.meta.get("val")
    if isinstance(obj, (list, tuple)):
        return type(obj)(fx_values(o) for o in obj)
    if isinstance(obj, dict):
        return {k: fx_values(v) for k, v in obj.items()}
    return obj
