"""Whether a reshape copies is decided as torch decides it, also inside a compile, where a meta tensor's
``view`` goes through torch's Python reference and refuses with a ValueError rather than a RuntimeError.

The reference is torch's own ``reshape`` on a real tensor of the same layout (a view shares its storage)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from fsdp_passes.dag.fusion import _copies, _viewable
from fsdp_passes.dag.from_fx import dag_from_fx


def _reshape_node(base_shape: list[int], columns: int, out_shape: list[int]):
    """A DAG node reshaping the first ``columns`` columns of a ``base_shape`` tensor to ``out_shape``, and
    whether torch copies for it."""
    real = torch.empty(base_shape)[:, :columns]
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty_strided(real.shape, real.stride(), device="meta")
    y = graph.call_function(torch.ops.aten.reshape.default, (x, out_shape))
    y.meta["val"] = torch.empty(out_shape, device="meta")
    graph.output(y)
    dag = dag_from_fx(graph)
    node = next(n for n in dag.nodes if n.origin is y)
    shares_storage = real.reshape(out_shape).untyped_storage().data_ptr() == real.untyped_storage().data_ptr()
    return node, not shares_storage


@pytest.mark.parametrize("columns", [96, 128])
def test_reshape_copy_decided_as_torch_does_inside_and_outside_a_compile(columns):
    from torch._dispatch.python import enable_python_dispatcher

    node, torch_copies = _reshape_node([8, 128], columns, [8 * columns])
    assert torch_copies is (columns != 128)  # the test's own premise: a column slice cannot be flattened in place
    _viewable.cache_clear()  # each layout is probed once: probe it inside first
    with enable_python_dispatcher():  # as inside Inductor's lowering
        assert _copies(node) is torch_copies
    _viewable.cache_clear()
    assert _copies(node) is torch_copies
