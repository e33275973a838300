"""The FX pass's estimate of a graph (its DAG contracted to predicted kernels) against the scheduler pass's
estimate of the same graph after Inductor's own fusion, from one compile.

The reference is Inductor's fusion: the scheduler nodes the compile produced (``capture_scheduler_nodes``),
priced by the same cost model.  The FX side is the post-grad graph that compile lowered
(``graph_lowering.module``), through ``dag_from_fx`` and ``predict_kernels``, run in the order
``predict_memory_reorder`` predicts Inductor's peak-memory reordering gives it; the scheduler side is the order
that reordering really gave (what the scheduler pass receives).
"""

import pytest
import torch

from fsdp_passes.cost_model import CostModel
from fsdp_passes.dag.fusion import predict_kernels
from fsdp_passes.dag.from_fx import dag_from_fx
from fsdp_passes.dag.memory_reorder import inductor_peak_estimate, predict_memory_reorder
from fsdp_passes.simulate import simulate
from fsdp_passes.testing import build_llama, build_mlp, capture_scheduler_nodes, example_inputs

_PLANS = {"mlp": ["layers.[0-9]"], "llama": ["tok_embeddings", "layers.[0-9]", ["norm", "output"]]}


# peaks the FX estimate misses by more than 10 %, and why (docs/design.md): Inductor fuses the Llama's backward
# differently (the SwiGLU backward with its sigmoid into one kernel, nodes of both layers that read the same
# buffers into one), and its least-peak-first order, run on its kernels, computes the weight gradients of both
# layers early; the same heuristic on the predicted kernels does not
_PEAK_GAPS = {("llama", False, "none", "backward"): 0.40, ("llama", False, "manual", "backward"): 0.40}


def _inductors_own_peak(cap):
    """Inductor's estimate (``torch._inductor.memory``) of the order it gave its nodes: an independent count
    of the same buffers."""
    from torch._inductor import memory
    from torch._inductor.virtualized import V

    with cap.graph_context():
        freeable = memory.get_freeable_input_buf(cap.before, set(V.graph.graph_inputs))
        return memory.estimate_peak_memory(cap.before, freeable, set(V.graph.get_output_names()))[0]


def _estimate(dag, cost_model, order=None):
    tl = simulate(dag, list(range(len(dag))) if order is None else order, cost_model.estimate(dag))
    return tl.makespan, tl.exposed_total, tl.peak_memory


def _close(a, b, tol=0.10):
    return abs(a - b) <= tol * max(abs(b), 1e-9)


@pytest.mark.parametrize("model_name", ["mlp", "llama"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "no_reshard"])
@pytest.mark.parametrize("bucketing", ["none", "manual"])
def test_fx_estimate_matches_scheduler_estimate(fake_pg, fresh_inductor, model_name, reshard, bucketing):
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes

    build = build_mlp if model_name == "mlp" else build_llama
    kwargs = {"n_layers": 2, "dim": 64} if model_name == "mlp" else {}
    model = build(reshard_after_forward=reshard, param_dtype=torch.bfloat16, **kwargs)
    options = {"bucketing": bucketing, "reorder": False}
    if bucketing == "manual":  # the plan as written (the default budget would split its buckets)
        options.update(bucket_plan=_PLANS[model_name], memory_budget="1GB")
    caps = capture_scheduler_nodes(model, *example_inputs(model), options=options)
    assert [c.graph_name for c in caps] == ["forward", "backward"]
    cost_model = CostModel.from_options("h100-nvlink")
    for cap in caps:
        with cap.graph_context():
            sched = dag_from_scheduler_nodes(cap.before)
        unfused = dag_from_fx(cap.graph_lowering.module)
        fused = predict_kernels(unfused)
        s_mk, s_exp, s_peak = _estimate(sched, cost_model)
        f_mk, f_exp, f_peak = _estimate(fused, cost_model, predict_memory_reorder(fused))
        where = f"{cap.graph_name}: fx {f_mk:.4f} ms / {f_exp:.4f} ms / {f_peak} B, scheduler {s_mk:.4f} / {s_exp:.4f} / {s_peak}"
        # same collectives in the same order on both sides
        assert [fused[i].comm_bytes for i in fused.collectives()] == [sched[i].comm_bytes for i in sched.collectives()]
        assert _close(f_mk, s_mk), where
        assert _close(f_exp, s_exp), where
        # node by node the FX graph is slower: each view and elementwise op priced as a kernel of its own
        assert _estimate(unfused, cost_model)[0] - s_mk > abs(f_mk - s_mk), where
        assert _close(f_peak, s_peak, _PEAK_GAPS.get((model_name, reshard, bucketing, cap.graph_name), 0.10)), where
        # the scheduler side counts Inductor's buffers as Inductor does (each output of a fused kernel freed
        # after its own last reader, one read only inside it at its step)
        assert inductor_peak_estimate(sched, list(range(len(sched)))) == _inductors_own_peak(cap), where


def test_predict_kernels_keeps_collectives_waits_and_extern_kernels(fake_pg, fresh_inductor):
    from fsdp_passes.testing import capture_fx_graphs

    model = build_mlp(n_layers=2, dim=32, reshard_after_forward=False)
    graphs = capture_fx_graphs(model, *example_inputs(model))
    dag = dag_from_fx(graphs.backward)
    fused = predict_kernels(dag)
    assert len(fused) < len(dag)
    assert [fused[i].name for i in fused.collectives()] == [dag[i].name for i in dag.collectives()]
    for i in fused.collectives():
        waits = fused.waits_of(i)
        assert len(waits) == 1 and fused[waits[0]].alias_of == i
    mms = sorted(n.name for n in dag if n.op.startswith("aten.mm"))
    assert mms == sorted(n.name for n in fused if n.op.startswith("aten.mm"))
    assert fused.order_violations(list(range(len(fused)))) == []


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "no_reshard"])
@pytest.mark.parametrize("bucketing", ["none", "manual"])
def test_predicted_memory_reorder_is_inductors_order(fake_pg, fresh_inductor, reshard, bucketing):
    """On Inductor's own fused nodes, in the order they had before its peak-memory reordering (the index its
    planning recorded), the prediction is the order Inductor generated."""
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes

    model = build_mlp(n_layers=2, dim=64, reshard_after_forward=reshard, param_dtype=torch.bfloat16)
    options = {"bucketing": bucketing, "reorder": False}
    if bucketing == "manual":
        options.update(bucket_plan=_PLANS["mlp"], memory_budget="1GB")
    caps = capture_scheduler_nodes(model, *example_inputs(model), options=options)
    for cap in caps:
        unordered = sorted(cap.before, key=lambda snode: snode.mpi_node.index)
        with cap.graph_context():
            dag = dag_from_scheduler_nodes(unordered)
        predicted = [dag[i].name for i in predict_memory_reorder(dag)]
        assert predicted == cap.before_names, cap.graph_name
