"""bucketing="auto" chooses among candidate plans by a rank-invariant overlap model, within the budget."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.fx as fx

from fsdp_passes.bucketing.blocks import block_keys, plan_per_block
from fsdp_passes.pipeline import bucket_graph
from fsdp_passes.pipeline.choice import SCORE_RESOLUTION, CandidateScore, score_plan
from fsdp_passes.pipeline.budget import graph_memory_budget
from fsdp_passes.bucketing.manual import plan_manual
from fsdp_passes.cost_model import CostModel
from fsdp_passes.dag.from_fx import dag_from_fx
from fsdp_passes.options import Options

N_LAYERS = 4


def _capture(batch: int, world: int = 8, dim: int = 64):
    from fsdp_passes.testing import build_mlp, capture_fx_graphs, example_inputs, fake_process_group

    torch._dynamo.reset()
    with fake_process_group(world_size=world):
        model = build_mlp(N_LAYERS, dim, reshard_after_forward=True)
        graphs = capture_fx_graphs(model, *example_inputs(model, batch=batch, seed=0))
    torch._dynamo.reset()
    return graphs.forward, graphs.backward


@pytest.fixture(scope="module")
def mlp():
    return _capture(batch=256)


@pytest.fixture(scope="module")
def tiny_batch():
    """Batch 1 on a slow link: the compute is negligible and communication dominates."""
    return _capture(batch=1)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def _scored(choice):
    return [c for c in choice.candidates if c.makespan_ms is not None and not (c.rejected or c.skipped or c.same_as)]


SLOW_LINK = {"base": "cpu-gloo", "intra_node_bw_gbps": 0.05, "inter_node_bw_per_nic_gbps": 0.05}


def test_block_keys():
    fqns = {0: "tok_embeddings.weight", 1: "layers.0.attention.wq.weight", 2: "layers.1.attention.wq.weight",
            3: "layers.10.feed_forward.w1.weight", 4: "norm.weight", 5: "output.weight", 6: None,
            7: "heads.0.weight", 8: "model.blocks.2.w", 9: "model.blocks.3.w", 10: "bias"}
    assert block_keys(fqns) == {0: "tok_embeddings", 1: "layers.0", 2: "layers.1", 3: "layers.10", 4: "norm",
                                5: "output", 6: None, 7: "heads", 8: "model.blocks.2", 9: "model.blocks.3",
                                10: "bias"}


def test_per_block_plan_is_one_bucket_per_layer(mlp):
    for gm in mlp:
        dag = dag_from_fx(gm.graph)
        plan = plan_per_block(dag)
        merged = [b for b in plan.buckets if len(b) > 1]
        assert sorted({b.label for b in merged}) == [f"block:layers.{i}" for i in range(N_LAYERS)]
        for b in merged:  # one (op, dtype) per bucket, all members of one layer
            assert len({p.split(".")[1] for p in b.params}) == 1


@pytest.mark.parametrize("cluster", ["h100-nvlink", "slow"])
@pytest.mark.parametrize("which", [0, 1])
def test_chosen_plan_is_best_by_the_simulator(mlp, which, cluster):
    gm = mlp[which]
    options = Options(bucketing="auto", memory_budget="100%", cluster=SLOW_LINK if cluster == "slow" else cluster)
    r = bucket_graph(_copy(gm), options)
    choice = r.choice
    scored = _scored(choice)
    assert len(scored) >= 2 and len(choice.candidates) <= 4
    best = min(c.makespan_ms for c in scored)
    winner = next(c for c in choice.candidates if c.name == choice.chosen)
    # the fastest, or as fast within the score's resolution and with fewer collectives than every other
    # candidate that is
    near = [c for c in scored if c.makespan_ms <= best * (1 + SCORE_RESOLUTION)]
    assert winner in near
    assert winner.n_collectives == min(c.n_collectives for c in near)
    # every candidate's memory claim is within the budget
    for c in scored:
        assert c.extra_bytes <= choice.memory_budget_bytes
    # the report says which candidate won and why
    doc = r.report.extra["bucketing"]["auto_choice"]
    json.dumps(doc)
    assert doc["chosen"] == choice.chosen
    assert {c["name"] for c in doc["candidates"]} <= {"greedy", "per_block", "none", "greedy_half_cap"}
    assert all({"makespan_ms", "exposed_ms", "extra_bytes", "n_collectives"} <= set(c) for c in doc["candidates"])
    # the graph got the winner's plan
    assert r.n_collectives_after == winner.n_collectives


def test_no_giant_bucket_when_per_block_is_better(tiny_batch):
    """Comm-bound forward on a slow link: one bucket of every gather cannot be prefetched under any compute;
    auto does not pick it, and its plan is at least as good as one bucket per block."""
    gm = tiny_batch[0]
    dag = dag_from_fx(gm.graph)
    options = Options(bucketing="auto", memory_budget="100%", cluster=SLOW_LINK)
    r = bucket_graph(_copy(gm), options)
    scores = {c.name: c for c in r.choice.candidates}
    n_gathers = len(dag.collectives())
    assert scores["per_block"].makespan_ms is not None
    # one giant bucket of every gather, scored the same way
    budget = graph_memory_budget(dag, options)
    giant_plan = plan_manual(dag, [["layers"]])
    assert [len(b) for b in giant_plan.buckets] == [n_gathers]
    cm = CostModel.from_options(SLOW_LINK)
    gs = score_plan(dag, giant_plan, options, cm, budget, CandidateScore(9, "giant", giant_plan))
    winner = scores[r.choice.chosen]
    assert gs.rejected or winner.makespan_ms < gs.makespan_ms
    assert r.n_collectives_after > 1 and max(len(b) for b in r.buckets) < n_gathers
    assert winner.makespan_ms <= scores["per_block"].makespan_ms * (1 + SCORE_RESOLUTION)


def test_deterministic(mlp):
    for gm in mlp:
        runs = []
        for _ in range(2):
            r = bucket_graph(_copy(gm), Options(bucketing="auto", memory_budget="100%"))
            runs.append(([b.member_names for b in r.buckets], json.dumps(r.to_json()["auto_choice"], sort_keys=True)))
        assert runs[0] == runs[1]


@pytest.mark.parametrize("budget", [0, 4096, "5%", "100%"])
def test_budget_respected(mlp, budget):
    """Every candidate's rank-invariant memory claim is within the budget (the peak itself is checked end to
    end against a compile without the passes in test_memory_budget_end_to_end.py)."""
    for gm in mlp:
        dag = dag_from_fx(gm.graph)
        options = Options(bucketing="auto", memory_budget=budget)
        limit = graph_memory_budget(dag, options).total
        r = bucket_graph(_copy(gm), options)
        assert r.choice.memory_budget_bytes == limit
        for c in r.choice.candidates:
            if c.extra_bytes is not None:
                assert c.rejected is not None or c.extra_bytes <= limit, c
        assert r.memory_budget_used_bytes <= limit
        if budget == 0:
            assert r.n_collectives_after == r.n_collectives_before


def test_reorder_off_scores_graph_order(mlp):
    r = bucket_graph(_copy(mlp[0]), Options(bucketing="auto", reorder=False, memory_budget="100%"))
    scored = _scored(r.choice)
    assert scored
    assert min(c.makespan_ms for c in scored) == next(c for c in scored if c.name == r.choice.chosen).makespan_ms


EMULATED_LINK = {"base": "cpu-gloo", "intra_node_bw_gbps": 0.05, "inter_node_bw_per_nic_gbps": 0.05,
                 "tflops_float32": 0.1}


def test_emulated_link_forward_avoids_a_giant_bucket():
    """The benchmark's failure, on 4 layers: one bucket of every forward gather cannot be prefetched under
    anything; the score prefers finer buckets.  (The greedy planner used to build it; with gloo's late chunk
    priced, an all-gather's cost grows with its size and greedy no longer does.)"""
    fwd, _ = _capture(batch=1024, world=2, dim=512)
    options = Options(bucketing="auto", memory_budget="100%", cluster=EMULATED_LINK)
    r = bucket_graph(_copy(fwd), options)
    scores = {c.name: c for c in r.choice.candidates}
    dag = dag_from_fx(fwd.graph)
    giant_plan = plan_manual(dag, [["layers"]])
    assert [len(b) for b in giant_plan.buckets] == [len(dag.collectives())]
    giant = score_plan(dag, giant_plan, options, CostModel.from_options(EMULATED_LINK),
                       graph_memory_budget(dag, Options(memory_budget="1000%")),  # scored even over the budget
                       CandidateScore(9, "giant", giant_plan))
    winner = scores[r.choice.chosen]
    # cpu-gloo's compute runs 1.9x slower under a collective (measured), so hiding gains less than on a
    # free overlap: finer buckets still win by more than 5 %
    assert winner.makespan_ms < 0.95 * giant.makespan_ms
    assert winner.makespan_ms <= scores["per_block"].makespan_ms * (1 + SCORE_RESOLUTION)
    assert max(len(b) for b in r.buckets) <= 4
    assert max(len(b) for b in scores["greedy"].plan.buckets) <= 4


def test_the_score_charges_the_profiles_issue_time(mlp):
    """Every collective's issue holds the compute stream for the profile's issue time in auto's score too: the
    unmerged candidate's (one collective per parameter) compute stream is busy that much longer per collective
    (busy = makespan - exposed)."""
    free = {"base": "h100-nvlink", "collective_issue_us": 0.0, "compute_slowdown_during_comm": 0.0}
    costly = dict(free, collective_issue_us=50.0)
    for gm in mlp:
        runs = {name: {c.name: c for c in bucket_graph(_copy(gm), Options(bucketing="auto", memory_budget="100%",
                                                                           cluster=cluster)).choice.candidates}
                for name, cluster in (("free", free), ("costly", costly))}
        none_free, none_costly = runs["free"]["none"], runs["costly"]["none"]
        busy_free = none_free.makespan_ms - none_free.exposed_ms
        busy_costly = none_costly.makespan_ms - none_costly.exposed_ms
        assert busy_costly == pytest.approx(busy_free + 0.050 * none_free.n_collectives)


def test_prefetch_only_within_what_the_plan_leaves_of_the_budget(mlp):
    """The reordering gets what the plan leaves of the memory budget (``reorder_graph``): a plan that claims all
    of it cannot be prefetched, and the score issues its gathers when first needed, as with reorder off; with
    room for every bucket, gathers are issued ahead and the forward's modelled step is shorter."""
    from fsdp_passes.pipeline.budget import MemoryBudget, memory_claim

    gm = mlp[0]
    dag = dag_from_fx(gm.graph)
    plan = plan_per_block(dag)
    claim = memory_claim(plan.buckets)
    payload = sum(dag.nodes[c].comm_bytes for c in dag.collectives())
    cm = CostModel.from_options(SLOW_LINK)

    def scored(budget_bytes: int, reorder: bool) -> CandidateScore:
        options = Options(bucketing="auto", reorder=reorder, cluster=SLOW_LINK)
        return score_plan(dag, plan, options, cm, MemoryBudget(total=budget_bytes), CandidateScore(0, "per_block", plan))

    no_room = scored(claim, reorder=True)
    assert no_room.rejected is None
    assert no_room.makespan_ms == pytest.approx(scored(claim, reorder=False).makespan_ms)
    assert scored(claim + payload, reorder=True).makespan_ms < no_room.makespan_ms
