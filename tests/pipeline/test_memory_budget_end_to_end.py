"""``memory_budget`` holds end to end: the peak of the final order <= the peak of Inductor's own order of the same
graph compiled without the passes + the budget, for every graph, in every mode.

Both peaks are computed the same way, by the one memory model (``fsdp_passes.simulate.peak_memory``) over the
scheduler nodes Inductor would generate code from (``fsdp_passes.testing.end_to_end.measure_compile``): the
baseline from a compile with the passes off, the budget in bytes from that compile's FSDP payload.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fsdp_passes
from fsdp_passes import Options
from fsdp_passes.testing import build_llama, build_mlp, capture_fx_graphs, example_inputs
from fsdp_passes.testing.end_to_end import measure_compile

# three blocks: a budget of "2 blocks" lets some, not all, of the per-block buckets merge
MODELS = {
    "mlp": lambda: build_mlp(3, 64, reshard_after_forward=True),
    "mlp-noreshard": lambda: build_mlp(3, 64, reshard_after_forward=False),
    "mlp-bf16": lambda: build_mlp(3, 64, reshard_after_forward=True, param_dtype=torch.bfloat16,
                                  reduce_dtype=torch.float32),
    "llama": lambda: build_llama(2, 64, seq_len=16, reshard_after_forward=True),
}

MODES = {
    "auto": lambda model: dict(bucketing="auto"),
    "manual-per-block": lambda model: dict(bucketing="manual", bucket_plan=(
        ["tok_embeddings", "layers.[0-1]", ["norm", "output"]] if model == "llama" else ["layers.[0-2]"])),
    "manual-one-bucket": lambda model: dict(bucketing="manual", bucket_plan=(
        [["tok_embeddings", "layers", "norm", "output"]] if model == "llama" else [["layers"]])),
    "none": lambda model: dict(bucketing="none"),
}

BUDGETS = [0, "5%", "2 blocks", 100_000]

# a Latin square: every (mode, budget) pair exactly once, and on every model each mode and each budget once
SWEEP = [(model, mode, BUDGETS[(k + shift) % len(BUDGETS)])
         for shift, model in enumerate(MODELS) for k, mode in enumerate(MODES)]
assert len({(mode, budget) for _, mode, budget in SWEEP}) == len(MODES) * len(BUDGETS)

BATCH = 8


@pytest.fixture(scope="module")
def baselines():
    """Per model: per graph, the peak and the FSDP payload of Inductor's order without the passes."""
    from fsdp_passes.bucketing.plan import fsdp_payload_bytes
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
    from fsdp_passes.simulate import peak_memory
    from fsdp_passes.testing import capture_scheduler_nodes, fake_process_group

    out = {}
    with fake_process_group(world_size=8):
        for name, make in MODELS.items():
            model = make()
            torch._dynamo.reset()
            graphs = {}
            for cap in capture_scheduler_nodes(model, *example_inputs(model, batch=BATCH, seed=0)):
                with cap.graph_context():
                    dag = dag_from_scheduler_nodes(cap.after)
                graphs[cap.graph_name] = (peak_memory(dag, list(range(len(dag)))), fsdp_payload_bytes(dag))
            out[name] = graphs
    torch._dynamo.reset()
    return out


@pytest.mark.parametrize("model_name, mode, budget", SWEEP, ids=[f"{m}-{mode}-{b}" for m, mode, b in SWEEP])
def test_final_peak_within_no_pass_peak_plus_budget(fake_pg, fresh_inductor, baselines, model_name, mode, budget):
    model = MODELS[model_name]()
    options = dict(MODES[mode](model_name), memory_budget=budget, reorder=True)
    fsdp_passes.last_reports(clear=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # manual plans over the budget are split with a warning (tested below)
        measures = measure_compile(model, *example_inputs(model, batch=BATCH, seed=0), options=options)
    reports = fsdp_passes.last_reports()
    assert not [r.fallback for r in reports if r.fallback]
    scheduler = [r for r in reports if r.pass_name == "scheduler"]
    assert [m.graph_name for m in measures] == list(baselines[model_name]) and len(scheduler) == len(measures)
    for measure, report in zip(measures, scheduler):
        base_peak, payload = baselines[model_name][measure.graph_name]
        if budget == "2 blocks":
            # a block is the per-block plan's claim, found on the graph the pass sees: the reported budget,
            # at least the claim of one merged block bucket when the FX pass planned it
            budget_bytes = report.budget.memory_budget_bytes
            assert budget_bytes > 0
        else:
            budget_bytes = Options(memory_budget=budget).memory_budget_bytes(payload, 0)
        assert measure.peak_bytes <= base_peak + budget_bytes, (
            f"{measure.graph_name}: final peak {measure.peak_bytes} B > no-pass peak {base_peak} B + budget "
            f"{budget_bytes} B")
        # the report states the budget and the final peak (measured independently here)
        assert report.budget.memory_budget_bytes == budget_bytes
        assert report.peak_memory_bytes_after == measure.peak_bytes
        assert report.extra["memory_limit_bytes"] == (report.peak_memory_bytes_before
                                                      + report.extra["reorder_budget_bytes"])
        if mode == "none":  # the graph Inductor ordered is the no-pass graph: its peak is the baseline
            assert report.peak_memory_bytes_before == base_peak
        fx = [r for r in reports if r.pass_name == "fx" and r.graph == report.graph]
        if mode != "none":
            assert fx and fx[0].budget.memory_budget_bytes == budget_bytes
            assert fx[0].budget.memory_budget_used_bytes <= budget_bytes
        if budget == 0:
            assert measure.peak_bytes <= base_peak


def test_sweep_is_not_vacuous(fake_pg, fresh_inductor, baselines):
    """With a generous budget the passes do use memory (merge, prefetch) and still keep the promise."""
    model = MODELS["mlp"]()
    fsdp_passes.last_reports(clear=True)
    measures = measure_compile(model, *example_inputs(model, batch=BATCH, seed=0),
                               options=dict(bucketing="auto", memory_budget="100%", cluster="cpu-gloo"))
    fx = [r for r in fsdp_passes.last_reports() if r.pass_name == "fx"]
    assert all(r.n_collectives_after < r.n_collectives_before for r in fx)
    assert any(m.peak_bytes > baselines["mlp"][m.graph_name][0] for m in measures)


@pytest.fixture(scope="module")
def mlp_fx():
    from fsdp_passes.testing import fake_process_group

    with fake_process_group(world_size=8):
        model = build_mlp(4, 64, reshard_after_forward=True)
        graphs = capture_fx_graphs(model, *example_inputs(model, batch=BATCH, seed=0))
    torch._dynamo.reset()
    return graphs


def test_manual_plan_over_budget_is_split_with_a_warning(mlp_fx):
    from fsdp_passes.pipeline import bucket_graph

    plan = dict(bucketing="manual", bucket_plan=[["layers"]])
    gm = copy.deepcopy(mlp_fx.forward)
    with pytest.warns(UserWarning, match=r"bucket_plan buckets '\[layers\] \(all_gather, 16 collectives\)'"):
        r = bucket_graph(gm, Options(**plan, memory_budget="50%"))
    assert 1 < r.n_collectives_after < r.n_collectives_before  # split, not dropped
    assert r.memory_budget_used_bytes <= r.memory_budget_bytes
    assert all(b.close_reason in ("memory", "plan", "end") for b in r.buckets)
    # within the budget: kept as asked, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = bucket_graph(copy.deepcopy(mlp_fx.forward), Options(**plan, memory_budget="300%"))
    assert r.n_collectives_after == 1


def test_one_memory_budget_per_fx_pass(mlp_fx, monkeypatch):
    """bucket_graph computes the graph's budget once and hands it to plan_bucketing; the plan is the one
    plan_bucketing makes when it computes the budget itself."""
    import importlib

    from fsdp_passes.dag.from_fx import dag_from_fx
    from fsdp_passes.pipeline import bucket_graph, plan_bucketing
    from fsdp_passes.pipeline.budget import graph_memory_budget

    # over the budget: the plan is trimmed, so it depends on the budget
    options = Options(bucketing="manual", bucket_plan=[["layers"]], memory_budget="50%")
    with pytest.warns(UserWarning, match="bucket_plan buckets"):
        alone = plan_bucketing(dag_from_fx(copy.deepcopy(mlp_fx.forward).graph), options)
    assert 1 < alone.n_collectives_after < alone.n_collectives_before

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0])
        return graph_memory_budget(*args, **kwargs)

    for module in ("fsdp_passes.pipeline.bucket_graph", "fsdp_passes.pipeline.plans"):  # where it is looked up
        monkeypatch.setattr(importlib.import_module(module), "graph_memory_budget", counted)
    with pytest.warns(UserWarning, match="bucket_plan buckets"):
        r = bucket_graph(copy.deepcopy(mlp_fx.forward), options)
    assert len(calls) == 1
    assert r.buckets == alone.buckets
    # handed a budget, plan_bucketing computes none
    dag = dag_from_fx(copy.deepcopy(mlp_fx.forward).graph)
    given = graph_memory_budget(dag, options)
    calls.clear()
    with pytest.warns(UserWarning, match="bucket_plan buckets"):
        assert plan_bucketing(dag, options, budget=given).buckets == alone.buckets
    assert calls == []


def test_manual_plan_over_budget_raises_when_strict(mlp_fx):
    from fsdp_passes.pipeline import bucket_graph
    from fsdp_passes.pipeline.budget import BucketOverBudget

    gm = copy.deepcopy(mlp_fx.backward)
    code = gm.code
    with pytest.raises(BucketOverBudget, match="layers"):
        bucket_graph(gm, Options(bucketing="manual", bucket_plan=[["layers"]], memory_budget=0, strict=True))
    assert gm.code == code


def test_report_before_figures_describe_the_graph_before_the_rewrite(mlp_fx):
    """The FX report's "before" figures are those of the captured graph, simulated on its own, not of the graph
    half rewritten by the merge."""
    from fsdp_passes.cost_model import CostModel
    from fsdp_passes.dag.from_fx import dag_from_fx
    from fsdp_passes.dag.fusion import predict_kernels
    from fsdp_passes.dag.memory_reorder import predict_memory_reorder
    from fsdp_passes.pipeline import bucket_graph
    from fsdp_passes.simulate import simulate

    options = Options(bucketing="manual", bucket_plan=[["layers"]], memory_budget="300%")
    r = bucket_graph(copy.deepcopy(mlp_fx.backward), options)
    assert r.n_collectives_after < r.n_collectives_before
    kernels = predict_kernels(dag_from_fx(copy.deepcopy(mlp_fx.backward)))
    cost_model = CostModel.from_options(options.cluster, options.calibration)
    untouched = simulate(kernels, predict_memory_reorder(kernels), cost_model.estimate(kernels),
                         cost_model.overlap_costs())
    assert r.report.peak_memory_bytes_before == untouched.peak_memory
    assert r.report.makespan_ms_before == pytest.approx(untouched.makespan)
    assert r.report.exposed_comm_ms_before == pytest.approx(untouched.exposed_total)


@pytest.mark.parametrize("plan", ["merged", "moved"])
def test_fx_pass_failure_after_changing_the_graph_restores_it(mlp_fx, monkeypatch, plan):
    """A failure after the pass changed the graph leaves it as captured: after a merge (restored from the copy
    taken before it) and after moves only (restored by the node order)."""
    import importlib

    from fsdp_passes.inductor.fx_pass import run_fx_pass

    bucket_graph_module = importlib.import_module("fsdp_passes.pipeline.bucket_graph")  # the package exports the function

    gm = copy.deepcopy(mlp_fx.backward)
    code = gm.code
    changed = []

    def structure(graph):  # each node's op, target and arguments (other nodes by position): names aside
        position = {n: i for i, n in enumerate(graph.nodes)}
        return [(n.op, str(n.target), str(torch.fx.node.map_arg((n.args, n.kwargs), position.__getitem__)))
                for n in graph.nodes]

    captured = structure(gm.graph)

    def metas(graph):  # what later passes read from a node: its meta keys (other than our caches), value shapes
        return [(n.type, sorted(k for k in n.meta if not k.startswith("fsdp_passes_")),
                 str(getattr(n.meta.get("val"), "shape", None)),
                 str(getattr(n.meta.get("val"), "dtype", None))) for n in graph.nodes]

    captured_meta = metas(gm.graph)

    def reductions(graph):
        return sum(1 for n in graph.nodes if "reduce_scatter" in str(n.target))

    n_reductions = reductions(gm.graph)

    def place_then_fail(graph, *args, **kwargs):
        moved = issue_gathers_before_reductions(graph, *args, **kwargs)
        # what changed before the failure: gathers moved, or the collectives merged
        changed.append(moved if plan == "moved" else reductions(gm.graph) < n_reductions)
        raise RuntimeError("injected failure after the rewrite")

    issue_gathers_before_reductions = bucket_graph_module.issue_gathers_before_reductions
    monkeypatch.setattr(bucket_graph_module, "issue_gathers_before_reductions", place_then_fail)
    options = (Options(bucketing="manual", bucket_plan=[["layers"]], memory_budget="300%", reorder=True)
               if plan == "merged" else Options(bucketing="none", reorder=True))
    with pytest.warns(RuntimeWarning, match="injected failure after the rewrite"):
        report = run_fx_pass(gm.graph, options, "backward")
    assert report.fallback and changed and changed[0]
    assert structure(gm.graph) == captured
    assert metas(gm.graph) == captured_meta
    gm.recompile()
    if plan == "moved":  # the same nodes, back in their order (a restored copy has nodes of new names)
        assert gm.code == code
