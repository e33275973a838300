"""One rule says which collectives are FSDP-like (``dag.ops.mark_fsdp``): the FX view and the scheduler-node view
of the same graph agree on every collective, including an all-gather of an all-reduce's output (not FSDP)."""

from __future__ import annotations

import pytest
import torch

from fsdp_passes.dag import CollectiveOp, NodeKind
from fsdp_passes.dag.from_fx import dag_from_fx
from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
from fsdp_passes.testing import build_mlp, capture_fx_graphs, capture_scheduler_nodes, example_inputs

c10d = torch.ops._c10d_functional


def _flags(dag):
    return [(n.collective, n.group_name, n.comm_bytes, n.fsdp) for n in dag if n.kind is NodeKind.COLLECTIVE]


def _both_views(fn, *args):
    graphs = capture_fx_graphs(fn, *args)
    caps = capture_scheduler_nodes(fn, *args)
    out = []
    for cap in caps:
        gm = graphs.forward if cap.graph_name in ("forward", "inference") else graphs.backward
        with cap.graph_context():
            s_dag = dag_from_scheduler_nodes(cap.before)
        out.append((dag_from_fx(gm), s_dag))
    return out


def test_gather_of_an_all_reduce_result_is_not_fsdp_in_either_view(fake_pg, fresh_inductor):
    def f(x, shard):
        reduced = c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", "0"))
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(reduced, 8, "0"))
        param = c10d.wait_tensor(c10d.all_gather_into_tensor(shard.to(torch.bfloat16), 8, "0"))
        return gathered.sum() + param.float().sum()

    ((fx_dag, s_dag),) = _both_views(f, torch.randn(4, 8), torch.randn(2, 8))
    assert _flags(fx_dag) == _flags(s_dag)
    gathers = [n for n in fx_dag if n.collective is CollectiveOp.ALL_GATHER]
    assert [n.fsdp for n in gathers] == [False, True]  # the all-reduce's result is not a parameter shard
    assert not any(n.fsdp for n in fx_dag if n.collective is CollectiveOp.ALL_REDUCE)


@pytest.mark.parametrize("options", [dict(reshard_after_forward=True),
                                     dict(reshard_after_forward=False, param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.float32)], ids=["reshard", "bf16-noreshard"])
def test_mlp_collectives_classified_alike(fake_pg, fresh_inductor, options):
    model = build_mlp(2, 32, **options)
    views = _both_views(model, *example_inputs(model))
    assert len(views) == 2
    for fx_dag, s_dag in views:
        assert _flags(fx_dag) == _flags(s_dag)
        # SimpleFSDP: every gather is a parameter gather, every reduce-scatter a gradient
        assert all(n.fsdp for n in fx_dag if n.kind is NodeKind.COLLECTIVE)


def test_hsdp_collectives_classified_alike(fake_pg, fresh_inductor):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_passes.testing.models import hsdp

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    model = hsdp(build_mlp(2, 32, fsdp=False), mesh)
    _, (fx_dag, s_dag) = _both_views(model, *example_inputs(model))
    assert _flags(fx_dag) == _flags(s_dag)
    ops = {n.collective for n in fx_dag if n.fsdp}
    assert ops == {CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE}


def test_a_forward_reduce_scatter_used_by_compute_and_saved_is_not_fsdp(fake_pg, fresh_inductor):
    """Sequence parallel's forward reduce-scatter (a row-parallel output) is read by the next compute (the
    residual add) and, saved for backward, is also a graph output: reaching an output is not enough to be a
    gradient's reduction; a gradient is not computed with in its own graph."""
    def f(x, residual, grad):
        partial = x @ x.t()  # a row-parallel matmul's partial sums
        sharded = c10d.wait_tensor(c10d.reduce_scatter_tensor(partial, "sum", 8, "0"))
        h = sharded + residual
        reduced_grad = c10d.wait_tensor(c10d.reduce_scatter_tensor(grad * 2, "sum", 8, "0"))
        return h.relu(), sharded, reduced_grad  # ``sharded`` saved, ``reduced_grad`` a gradient

    ((fx_dag, s_dag),) = _both_views(f, torch.randn(16, 8), torch.randn(2, 16), torch.randn(16, 4))
    assert _flags(fx_dag) == _flags(s_dag)
    scatters = [n for n in fx_dag if n.collective is CollectiveOp.REDUCE_SCATTER]
    assert [n.fsdp for n in scatters] == [False, True]
