"""Bucketing on models this package did not write: transformers GPT-2 and Qwen2, torchtitan's Qwen3, sharded
by torchtitan's SimpleFSDP frontend (no FQN annotations, parameters read through property getters, uneven
shards of a 251-token vocabulary).

Fake 8-rank group: a manual per-block plan in the model's own FQNs applies with ``strict=True`` and lowers
the simulated exposed communication; every collective is named (parameter and module); the blocks are
found; auto, run on the same captured graph, has a per-block candidate that merges something and falls back
to nothing; the FX pass's estimate of each bucketed graph (its predicted kernels in the predicted order)
is within 10 % of the scheduler pass's estimate of Inductor's nodes in Inductor's order (makespan, exposed
communication and peak, forward and backward).  2-rank gloo (GPT-2, one block): the compiled step with the passes
equals the compile without them bitwise and eager within 1e-5.  (Auto against the final schedule: test_third_party_auto.py.)
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

import fsdp_passes
from fsdp_passes.cost_model import CostModel
from fsdp_passes.options import Options
from fsdp_passes.pipeline import bucket_graph
from fsdp_passes.testing import capture_scheduler_nodes, fake_process_group, run_on_gloo

# the model builders live beside this file (test modules are imported by path, not as a package); the
# third-party packages they import are installed by ./dev.sh, so a missing one fails here instead of skipping
sys.path.insert(0, str(Path(__file__).resolve().parent))
from third_party_models import BLOCKS, MODELS, PER_BLOCK_PLANS, sharded_loss_module, token_ids  # noqa: E402


def _fx(reports):
    return [r for r in reports if r.pass_name == "fx"]


def _estimates(cap, cost_model):
    """(FX estimate, scheduler estimate) of one captured graph, each ``(makespan ms, exposed ms, peak bytes)``:
    the graph Inductor lowered, through ``dag_from_fx`` and ``predict_kernels``, in the order
    ``predict_memory_reorder`` predicts; Inductor's fused nodes in the order its peak-memory reordering gave
    them."""
    from fsdp_passes.dag.from_fx import dag_from_fx
    from fsdp_passes.dag.fusion import predict_kernels
    from fsdp_passes.dag.memory_reorder import predict_memory_reorder
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
    from fsdp_passes.simulate import simulate

    def run(dag, order):
        tl = simulate(dag, order, cost_model.estimate(dag), cost_model.overlap_costs())
        return tl.makespan, tl.exposed_total, tl.peak_memory

    with cap.graph_context():
        sched = dag_from_scheduler_nodes(cap.before)
    fused = predict_kernels(dag_from_fx(cap.graph_lowering.module))
    return run(fused, predict_memory_reorder(fused)), run(sched, list(range(len(sched))))


@pytest.mark.parametrize("name", MODELS)
def test_manual_per_block_plan_auto_and_names_on_fake_pg(name):
    with fake_process_group(world_size=8):
        model = sharded_loss_module(name, 8)
        fsdp_passes.last_reports(clear=True)
        plan = PER_BLOCK_PLANS[name]
        caps = capture_scheduler_nodes(model, token_ids(name), options=dict(
            bucketing="manual", bucket_plan=plan, strict=True, memory_budget="1GB"))
        reports = _fx(fsdp_passes.last_reports())
        assert [r.fallback for r in reports] == [None, None]
        params = {n for n, _ in model.named_parameters()}
        for r in reports:
            b = r.extra["bucketing"]
            # every collective has a parameter of the compiled module and the module that ran it
            assert b["unattributed"] == {}
            assert len(b["attribution"]) == r.n_collectives_before > 0
            for who in b["attribution"].values():
                assert who["param"] in params, who
                assert who["module"] and who["param"].startswith(who["module"] + "."), who
            assert sorted(b["blocks"]) == BLOCKS[name]
            # one bucket per plan entry (and op): far fewer collectives, and less exposed communication
            assert r.n_collectives_after <= len(plan) + 2 < r.n_collectives_before
            assert r.exposed_comm_ms_after < r.exposed_comm_ms_before
            # a layer's bucket holds that layer's parameters only
            for bucket in b["buckets"]:
                if bucket["label"].startswith(tuple(BLOCKS[name])):
                    assert all(p.startswith(bucket["label"] + ".") for p in bucket["params"]), bucket

        assert [c.graph_name for c in caps] == ["forward", "backward"]
        cost_model = CostModel.from_options("h100-nvlink")
        for cap in caps:
            fx_estimate, scheduler_estimate = _estimates(cap, cost_model)
            for got, want in zip(fx_estimate, scheduler_estimate):
                assert abs(got - want) <= 0.10 * want, (cap.graph_name, fx_estimate, scheduler_estimate)

        # auto on the same (unplanned) graphs: no fallback, its per-block candidate merges something
        for gm in (cap.fx_before for cap in caps):
            result = bucket_graph(copy.deepcopy(gm), Options(bucketing="auto", strict=True, memory_budget="1GB"))
            per_block = next(c for c in result.choice.candidates if c.name == "per_block")
            assert per_block.rejected is None and per_block.skipped is None
            assert sum(1 for b in per_block.plan.buckets if len(b) > 1) > 0
            assert sorted(result.blocks) == BLOCKS[name]
            assert result.report.exposed_comm_ms_after <= result.report.exposed_comm_ms_before


# one block on gloo: the numerics need a block's bucket, not several (blocks are checked on the fake group above)
GLOO_PLANS = {"gpt2": ["lm.transformer.wte", "lm.transformer.wpe", "lm.transformer.h.0", ["lm.transformer.ln_f", "lm.lm_head"]]}


def _steps(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    import torch
    import torch._dynamo
    import torch._inductor.config as ic

    ic.fx_graph_cache = False  # ranks compile different graphs (uneven shards): never share compiled code
    torch._functorch.config.enable_autograd_cache = False
    out = {}
    for name in names:
        ids = token_ids(name, seed=10 + rank)
        runs = {}
        for mode in ("eager", "compiled", "passes"):
            model = sharded_loss_module(name, world_size, n_layers=1)
            torch._dynamo.reset()
            fsdp_passes.last_reports(clear=True)
            if mode == "passes":
                fsdp_passes.enable(bucketing="manual", bucket_plan=GLOO_PLANS[name], strict=True, memory_budget="1GB")
            fn = model if mode == "eager" else torch.compile(model)
            loss = fn(ids)
            loss.backward()
            fsdp_passes.disable()
            runs[mode] = (loss.detach(), {n: p.grad.to_local().clone() for n, p in model.named_parameters()},
                          [(r.n_collectives_before, r.n_collectives_after) for r in _fx(fsdp_passes.last_reports())])
        eager, compiled, passes = runs["eager"], runs["compiled"], runs["passes"]
        out[name] = {
            "loss_bitwise_vs_compiled": bool(torch.equal(passes[0], compiled[0])),
            "grads_bitwise_vs_compiled": all(torch.equal(passes[1][p], g) for p, g in compiled[1].items()),
            "max_abs_vs_eager": max([(passes[0] - eager[0]).abs().item()]
                                    + [(passes[1][p] - g).abs().max().item() for p, g in eager[1].items()]),
            "uneven": any(p.shape[0] % world_size for p in model.parameters()),
            "collectives": passes[2],
        }
    return out


def test_passes_match_unplanned_compile_and_eager_on_gloo():
    # one model, one block: three full compiles per rank take minutes on two cores; GPT-2 has the uneven shards
    # (a 251-token vocabulary split 126 / 125) and goes through the same frontend as the other two
    names = ("gpt2",)
    results = run_on_gloo(2, _steps, names, timeout=1200)
    for rank, res in enumerate(results):
        for name in names:
            got = res[name]
            assert got["loss_bitwise_vs_compiled"] and got["grads_bitwise_vs_compiled"], (rank, name)
            assert got["max_abs_vs_eager"] <= 1e-5, (rank, name, got["max_abs_vs_eager"])
            assert len(got["collectives"]) == 2 and all(after < before for before, after in got["collectives"]), got
        assert res["gpt2"]["uneven"]  # the 251-row embedding is split 126 / 125

