"""Warn when a graph's FSDP shards differ in shape from their collective's even split.

A frontend that keeps uneven shards (e.g. ``DTensor`` ``Shard(0)`` of a dimension the group size does not
divide) pads them inside the graph before the all-gather and slices the reduce-scatter's output: ranks then
trace graphs of different shapes, and a cache directory shared by the ranks can serve one rank the code
compiled for another.  Seen on one rank as a dim-0 ``constant_pad_nd`` feeding an all-gather, or a dim-0
slice narrowing a reduce-scatter's result.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.fx as fx

log = logging.getLogger("fsdp_passes")

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
_PASS_THROUGH = (_aten._to_copy.default, torch.ops.prims.convert_element_type.default, _aten.clone.default)


def _rows(node: fx.Node) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return int(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[0], int) else None


def _padded_shard(gather: fx.Node) -> bool:
    x = gather.args[0]
    while isinstance(x, fx.Node) and x.target in _PASS_THROUGH:
        x = x.args[0]
    if not (isinstance(x, fx.Node) and x.target is _aten.constant_pad_nd.default):
        return False
    before, after = _rows(x.args[0]), _rows(x)
    return before is not None and after is not None and before < after


def _narrowed_shard(reduce_scatter: fx.Node) -> bool:
    for wait in reduce_scatter.users:
        for user in wait.users:
            if user.target is _aten.slice.Tensor and (user.args[1] if len(user.args) > 1 else 0) == 0:
                before, after = _rows(wait), _rows(user)
                if before is not None and after is not None and after < before:
                    return True
    return False


def has_uneven_shards(graph: fx.Graph) -> bool:
    """Whether ``graph`` pads an FSDP shard before its all-gather or narrows one after its reduce-scatter."""
    for node in graph.nodes:
        if node.target is _c10d.all_gather_into_tensor.default and _padded_shard(node):
            return True
        if node.target is _c10d.reduce_scatter_tensor.default and _narrowed_shard(node):
            return True
    return False


@functools.lru_cache(maxsize=1)
def _warn_once() -> None:
    log.warning(
        "fsdp_passes: FSDP shards in this graph differ in shape from their collective's even split (uneven "
        "shards padded inside the graph): ranks compile different graphs, so a cache directory shared by the "
        "ranks may serve one rank another rank's code. Give each rank its own TORCHINDUCTOR_CACHE_DIR, or "
        "shard with fsdp_passes.data_parallel, whose padded shards give every rank the same graph.")


def warn_if_uneven_shards(graph: fx.Graph) -> None:
    """Log the warning above once per process, the first time a graph with uneven shards is seen."""
    if has_uneven_shards(graph):
        _warn_once()
