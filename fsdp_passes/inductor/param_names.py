"""Parameter names for the collectives of any frontend: a pre-grad pass over Dynamo's graph.

Dynamo's graph still knows where each graph input came from: a parameter's placeholder carries its source
(``L['self']._modules['layers']._modules['0']._parameters['weight']``, read through a property's getter or
not).  The post-grad graph the bucketing pass sees has only ``primals_N``.  So this pass, installed in
``torch._inductor.config.pre_grad_custom_pass``, writes the parameter's FQN (in the naming of the module
given to ``torch.compile``) into ``node.meta["custom"]["fsdp_param"]`` of every node of the chain of
single-input ops that starts at the parameter (casts, ``redistribute``, ``to_local``, functional
collectives, views).  AOT autograd copies ``meta["custom"]`` to the nodes it traces from them, forward and
backward, so the all-gather of the parameter and its gradient's reduce-scatter carry the name.  A name
already there (this package's ``simple_fsdp`` annotates its own) is kept.

It also notices the graphs where nothing will be bucketed because no collective was traced at all
(FSDP2's ``fully_shard`` gathers in hooks that run outside the graph) and says so once per process.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..dag.from_fx import normalize_module_path
from ..debug.warn import warn_and_log

log = logging.getLogger("fsdp_passes")

#: ``node.meta["custom"]`` key holding the parameter FQN a node moves (same key as ``testing.FSDP_PARAM_META_KEY``)
PARAM_META_KEY = "fsdp_param"

# longest chain of single-input ops followed from a parameter (cast, redistribute, to_local, gather, wait,
# unpad, views): enough for every frontend seen, short enough never to walk into the model's compute
_MAX_CHAIN = 12


def parameter_fqns(graph: fx.Graph) -> dict[fx.Node, str]:
    """Dynamo graph: parameter placeholder (or ``get_attr``) node -> its FQN in the compiled module."""
    out: dict[fx.Node, str] = {}
    owner = graph.owning_module
    flat_to_fqn = getattr(owner, "meta", {}).get("dynamo_flat_name_to_original_fqn", {}) if owner is not None else {}
    for node in graph.nodes:
        if node.op == "placeholder":
            grapharg = node.meta.get("grapharg")
            source = getattr(grapharg, "source", None)
            name = getattr(source, "name", None)
            if callable(name):
                name = name()
            if isinstance(name, str) and "_parameters[" in name:
                out[node] = normalize_module_path(name)
        elif node.op == "get_attr" and str(node.target) in flat_to_fqn:
            out[node] = str(flat_to_fqn[node.target])
    return out


def annotate_parameter_names(graph: fx.Graph) -> int:
    """Write each parameter's FQN into the custom meta of the single-input chain it starts; returns how many
    nodes got a name."""
    named = 0
    for param, fqn in parameter_fqns(graph).items():
        frontier, depth = [param], 0
        while frontier and depth < _MAX_CHAIN:
            nxt = []
            for node in frontier:
                for user in node.users:
                    inner = _subgraph_placeholders(user, node)
                    if inner:  # read inside a checkpointed region (or another subgraph): follow it in there
                        nxt.extend(inner)
                        continue
                    if user.op not in ("call_function", "call_method") or len(user.all_input_nodes) != 1:
                        continue
                    custom = user.meta.get("custom")
                    if isinstance(custom, dict) and PARAM_META_KEY in custom:
                        continue  # named by its frontend, or reached from an earlier parameter
                    # a fresh dict: an annotation context may share one dict between many nodes
                    user.meta["custom"] = {**(custom if isinstance(custom, dict) else {}), PARAM_META_KEY: fqn}
                    named += 1
                    nxt.append(user)
            frontier, depth = nxt, depth + 1
    return named


def _subgraph_placeholders(call: fx.Node, operand: fx.Node) -> list[fx.Node]:
    """The placeholders through which a higher-order op's subgraph reads ``operand`` (``torch.utils.checkpoint``
    traces its function into ``tag_activation_checkpoint(body, *operands)``; ``wrap`` and ``invoke_subgraph``
    alike): the body's placeholders follow its operands, after any non-tensor arguments before them."""
    if call.op != "call_function" or not isinstance(call.target, torch._ops.HigherOrderOperator) or not call.args:
        return []
    body_ref = call.args[0]
    if not isinstance(body_ref, fx.Node) or body_ref.op != "get_attr":
        return []
    owner = call.graph.owning_module
    body = getattr(owner, str(body_ref.target), None) if owner is not None else None
    if not isinstance(body, fx.GraphModule):
        return []
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    operands = list(call.args[1:])
    while operands and len(operands) > len(placeholders) and not isinstance(operands[0], fx.Node):
        operands.pop(0)  # invoke_subgraph's identifier
    if len(operands) != len(placeholders):
        return []
    return [ph for ph, arg in zip(placeholders, operands) if arg is operand]


_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_dtensor")


def _is_collective_call(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return any(str(target).startswith(ns + ".") for ns in _COLLECTIVE_NAMESPACES)
    return node.op == "call_method" and target in ("redistribute", "full_tensor")


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def traces_no_collective(graph: fx.Graph) -> bool:
    """The graph reads parameters, none of them a DTensor, and calls no collective: nothing to bucket will
    appear in it."""
    params = parameter_fqns(graph)
    if not params:
        return False
    if any(_is_dtensor(p.meta.get("example_value")) for p in params):
        return False
    return not any(_is_collective_call(n) for n in _nodes_with_subgraphs(graph))


def _nodes_with_subgraphs(graph: fx.Graph):
    """The graph's nodes and those of the subgraphs it calls (an ``autograd.Function``'s forward and backward
    are traced into subgraph modules of Dynamo's graph)."""
    yield from graph.nodes
    owner = graph.owning_module
    if owner is not None:
        for module in owner.modules():
            if isinstance(module, fx.GraphModule) and module.graph is not graph:
                yield from module.graph.nodes


def _process_group_size() -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


NO_COLLECTIVE_MESSAGE = (
    "fsdp_passes: a compiled graph reads parameters but no collective was traced into it, so there is "
    "nothing to bucket or reorder. Parameters gathered by hooks that run outside the graph (FSDP2's "
    "fully_shard) are invisible to compiler passes; use a frontend that gathers inside the compiled graph "
    "(fsdp_passes.data_parallel, or torchtitan's SimpleFSDP data_parallel)."
)


@functools.lru_cache(maxsize=1)
def _warn_no_collective_once() -> None:
    warn_and_log(NO_COLLECTIVE_MESSAGE, UserWarning, stacklevel=3)


class ParamNamesPass(CustomGraphPass):
    """Pre-grad pass: name parameters' collectives (``annotate_parameter_names``), warn about graphs without
    collectives; then run the pass that was installed before ours."""

    def __init__(self, chained: Any = None) -> None:
        self.chained = chained

    def __call__(self, graph: fx.Graph) -> None:
        try:
            annotate_parameter_names(graph)
            if _process_group_size() > 1 and traces_no_collective(graph):
                _warn_no_collective_once()
        except Exception as exc:  # names are for planning and reports; a failure here must not stop a compile
            log.warning("fsdp_passes: could not name the parameters of a graph: %s: %s", type(exc).__name__, exc)
        if self.chained is not None:
            self.chained(graph)

    def uuid(self) -> str:
        import hashlib

        from .cache_key import package_fingerprint

        h = hashlib.sha256(b"pre_grad_names" + package_fingerprint().encode())
        if self.chained is not None:
            h.update(repr(self.chained.uuid() if hasattr(self.chained, "uuid") else self.chained).encode())
        return h.hexdigest()


__all__ = ["PARAM_META_KEY", "NO_COLLECTIVE_MESSAGE", "ParamNamesPass", "annotate_parameter_names",
           "parameter_fqns", "traces_no_collective"]
