"""The FX pass's estimate of a graph (its DAG contracted to predicted kernels) against the scheduler pass's
estimate of the same graph after Inductor's own fusion, from one compile.

The reference is Inductor's fusion: the scheduler nodes the compile produced (``capture_scheduler_nodes``),
priced by the same cost model.  The FX side is the post-grad graph that compile lowered
(``graph_lowering.module``), through ``dag_from_fx`` and ``predict_kernels``, run in the order
``predict_memory_reorder`` predicts Inductor's peak-memory reordering gives it; the scheduler side is the order
that reordering really gave (what the scheduler pass receives).
"""

from dataclasses import dataclass

import pytest
import torch

from fsdp_passes.cost_model import CostModel
from fsdp_passes.dag.fusion import predict_kernels
from fsdp_passes.dag.from_fx import dag_from_fx
from fsdp_passes.dag.memory_reorder import inductor_peak_estimate, predict_memory_reorder
from fsdp_passes.simulate import simulate
from fsdp_passes.testing import build_llama, build_mlp, capture_scheduler_nodes, example_inputs

_PLANS = {"mlp": ["layers.[0-9]"], "llama": ["tok_embeddings", "layers.[0-9]", ["norm", "output"]]}


def _inductors_own_peak(cap):
    """Inductor's estimate (``torch._inductor.memory``) of the order it gave its nodes: an independent count
    of the same buffers."""
    from torch._inductor import memory
    from torch._inductor.virtualized import V

    with cap.graph_context():
        freeable = memory.get_freeable_input_buf(cap.before, set(V.graph.graph_inputs))
        return memory.estimate_peak_memory(cap.before, freeable, set(V.graph.get_output_names()))[0]


def _estimate(dag, cost_model, order=None):
    tl = simulate(dag, list(range(len(dag))) if order is None else order, cost_model.estimate(dag),
                  cost_model.overlap_costs())
    return tl.makespan, tl.exposed_total, tl.peak_memory


def _close(a, b, tol=0.10):
    return abs(a - b) <= tol * max(abs(b), 1e-9)


@dataclass
class _Graph:
    """What the tests read off one captured graph, taken while its compile's process group lives."""

    name: str
    sched: object  # the DAG of Inductor's fused nodes, in the order its peak-memory reordering gave them
    unfused: object  # the DAG of the post-grad FX graph Inductor lowered
    own_peak: int  # Inductor's own peak estimate of that order
    unordered: object  # the DAG of Inductor's fused nodes, in the order before its peak-memory reordering
    before_names: list


@pytest.fixture(scope="module")
def compiled():
    """``(model, reshard, bucketing) -> [_Graph]``: one capture per configuration, shared by the tests below."""
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
    from fsdp_passes.testing import fake_process_group

    cache = {}

    def get(model_name, reshard, bucketing):
        key = (model_name, reshard, bucketing)
        if key not in cache:
            build = build_mlp if model_name == "mlp" else build_llama
            kwargs = {"n_layers": 2, "dim": 64} if model_name == "mlp" else {}
            options = {"bucketing": bucketing, "reorder": False}
            if bucketing == "manual":  # the plan as written (the default budget would split its buckets)
                options.update(bucket_plan=_PLANS[model_name], memory_budget="1GB")
            graphs = []
            with fake_process_group(world_size=8):
                model = build(reshard_after_forward=reshard, param_dtype=torch.bfloat16, **kwargs)
                for cap in capture_scheduler_nodes(model, *example_inputs(model), options=options):
                    with cap.graph_context():
                        sched = dag_from_scheduler_nodes(cap.before)
                        unordered = dag_from_scheduler_nodes(
                            sorted(cap.before, key=lambda snode: snode.mpi_node.index))
                    graphs.append(_Graph(cap.graph_name, sched, dag_from_fx(cap.graph_lowering.module),
                                         _inductors_own_peak(cap), unordered, cap.before_names))
            cache[key] = graphs
        return cache[key]

    return get


@pytest.mark.parametrize("model_name", ["mlp", "llama"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "no_reshard"])
@pytest.mark.parametrize("bucketing", ["none", "manual"])
def test_fx_estimate_matches_scheduler_estimate(fresh_inductor, compiled, model_name, reshard, bucketing):
    graphs = compiled(model_name, reshard, bucketing)
    assert [g.name for g in graphs] == ["forward", "backward"]
    cost_model = CostModel.from_options("h100-nvlink")
    for g in graphs:
        sched, unfused = g.sched, g.unfused
        fused = predict_kernels(unfused)
        s_mk, s_exp, s_peak = _estimate(sched, cost_model)
        f_mk, f_exp, f_peak = _estimate(fused, cost_model, predict_memory_reorder(fused))
        where = f"{g.name}: fx {f_mk:.4f} ms / {f_exp:.4f} ms / {f_peak} B, scheduler {s_mk:.4f} / {s_exp:.4f} / {s_peak}"
        # same collectives in the same order on both sides
        assert [fused[i].comm_bytes for i in fused.collectives()] == [sched[i].comm_bytes for i in sched.collectives()]
        assert _close(f_mk, s_mk), where
        assert _close(f_exp, s_exp), where
        # node by node the FX graph is slower: each view and elementwise op priced as a kernel of its own
        assert _estimate(unfused, cost_model)[0] - s_mk > abs(f_mk - s_mk), where
        assert _close(f_peak, s_peak), where
        # the scheduler side counts Inductor's buffers as Inductor does (each output of a fused kernel freed
        # after its own last reader, one read only inside it at its step)
        assert inductor_peak_estimate(sched, list(range(len(sched)))) == g.own_peak, where


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
def test_predicted_memory_reorder_is_inductors_order(fresh_inductor, compiled, reshard, bucketing):
    """On Inductor's own fused nodes, in the order they had before its peak-memory reordering (the index its
    planning recorded), the prediction is the order Inductor generated (the MLP's captures of the test above)."""
    for g in compiled("mlp", reshard, bucketing):
        predicted = [g.unordered[i].name for i in predict_memory_reorder(g.unordered)]
        assert predicted == g.before_names, g.name
