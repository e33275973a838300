"""Mixture-of-experts graphs (transformers Mixtral and Qwen2-MoE under ``data_parallel``): both passes run on
them with ``strict=True`` (a fallback raises), bucketing merges, and each block's bucket holds its experts.

Fake 8-rank group: default options and a strict per-block plan, with the experts as ``grouped_mm`` (one graph
per step) and as transformers' eager loop over experts (token routing by data: graph breaks, several graphs
per step).  2-rank gloo (Mixtral, one layer): a step with the passes stays within float32 rounding of the
compile without them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fsdp_passes
from fsdp_passes.testing import capture_fx_graphs, fake_process_group, run_on_gloo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_models import MOE_MODELS, per_block_plan, sharded_moe_loss, token_ids  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import fresh_compile_state  # noqa: E402


def _fx_reports():
    return [r for r in fsdp_passes.last_reports() if r.pass_name == "fx"]


@pytest.mark.parametrize("name", MOE_MODELS)
def test_defaults_and_strict_per_block_plan_on_grouped_mm_experts(name):
    with fake_process_group(world_size=8):
        model = sharded_moe_loss(name, 8)
        # data_parallel names its parameters in the module it sharded (the LM inside the loss module)
        params = {n for n, _ in model.lm.named_parameters()}
        fsdp_passes.last_reports(clear=True)
        capture_fx_graphs(model, token_ids(), options=dict(strict=True))
        auto = _fx_reports()
        fsdp_passes.last_reports(clear=True)
        capture_fx_graphs(model, token_ids(), options=dict(bucketing="manual", bucket_plan=per_block_plan(),
                                                           strict=True, memory_budget="1GB"))
        manual = _fx_reports()
    for reports in (auto, manual):
        assert [r.fallback for r in reports] == [None, None]
        assert all(r.n_collectives_after < r.n_collectives_before for r in reports)
    for r in manual:
        b = r.extra["bucketing"]
        assert b["unattributed"] == {} and {w["param"] for w in b["attribution"].values()} <= params
        for layer in ("model.layers.0", "model.layers.1"):
            buckets = [k for k in b["buckets"] if k["label"] == "lm." + layer]
            assert buckets, (layer, [k["label"] for k in b["buckets"]])
            held = {p for k in buckets for p in k["params"]}
            # the layer's experts (and router) travel in its bucket, and nothing of another layer does
            assert {p for p in params if p.startswith(layer + ".mlp.")} <= held
            assert all(p.startswith(layer + ".") for p in held), sorted(held)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_eager_experts_with_graph_breaks(name):
    with fake_process_group(world_size=8):
        model = sharded_moe_loss(name, 8, experts="eager", n_layers=1)
        fsdp_passes.last_reports(clear=True)
        capture_fx_graphs(model, token_ids(), options=dict(strict=True), fullgraph=False)
        reports = _fx_reports()
    with_collectives = [r for r in reports if r.n_collectives_before]
    assert len(reports) > 2 and with_collectives  # broken into several graphs, collectives in some
    assert [r.fallback for r in reports] == [None] * len(reports)
    assert any(r.n_collectives_after < r.n_collectives_before for r in with_collectives)


def _steps(rank: int, world_size: int) -> dict:
    import torch

    fresh_compile_state()
    out = {}
    for mode in ("plain", "passes"):
        model = sharded_moe_loss("mixtral", world_size, n_layers=1)
        torch._dynamo.reset()
        fsdp_passes.last_reports(clear=True)
        if mode == "passes":
            fsdp_passes.enable(strict=True)
        loss = torch.compile(model)(token_ids(seed=10 + rank))
        loss.backward()
        fsdp_passes.disable()
        # numpy arrays: a returned tensor would cross to the parent by shared memory, gone with this process
        out[mode] = (loss.item(), {n: p.grad.to_local().numpy() for n, p in model.named_parameters()},
                     [(r.n_collectives_before, r.n_collectives_after) for r in _fx_reports()])
    return out


def test_mixtral_step_with_passes_equals_the_compile_without_them_on_gloo():
    import numpy as np

    for rank, res in enumerate(run_on_gloo(2, _steps, timeout=600)):
        (loss, grads, _), (loss_p, grads_p, counts) = res["plain"], res["passes"]
        assert counts and all(after < before for before, after in counts), counts
        # within float32 rounding, not bitwise: merged buckets change Inductor's kernels around them (a few ulps)
        assert np.isclose(loss_p, loss, rtol=1e-6, atol=0), rank
        for name, g in grads.items():
            assert np.allclose(grads_p[name], g, rtol=1e-6, atol=2e-7), (rank, name)
