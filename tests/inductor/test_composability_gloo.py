"""Real gloo groups: HSDP numerics (4 ranks, 2 x 2 mesh) and ``verify_rank_consistency`` (2 ranks)."""

from __future__ import annotations

import pytest

from fsdp_passes.testing import example_inputs, run_on_gloo


def _hsdp_step(rank: int, world_size: int) -> dict:
    import torch._dynamo
    import torch._inductor.config as ic
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_passes
    from fsdp_passes.testing import build_mlp
    from fsdp_passes.testing.models import hsdp

    ic.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(100 + rank)
    (x,) = example_inputs(build_mlp(1, 32, fsdp=False), batch=4)
    out = {}
    for name in ("eager", "compiled"):
        model = hsdp(build_mlp(2, 32, fsdp=False), mesh)
        torch._dynamo.reset()
        fsdp_passes.last_reports(clear=True)
        if name == "compiled":
            fsdp_passes.enable(bucketing="manual", bucket_plan=["layers.[0-1]"], strict=True, memory_budget="1GB")
            fn = torch.compile(model)
        else:
            fn = model
        loss = fn(x).square().mean()
        loss.backward()
        fsdp_passes.disable()
        out[name] = (loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()},
                     [(r.graph, r.pass_name, r.n_collectives_before, r.n_collectives_after, r.fallback)
                      for r in fsdp_passes.last_reports()])
    (le, ge, _), (lc, gc, reports) = out["eager"], out["compiled"]
    return {
        "loss_diff": (lc - le).abs().item(),
        "max_rel": max(((gc[p] - g).norm() / g.norm().clamp_min(1e-30)).item() for p, g in ge.items()),
        "reports": reports,
    }


def test_hsdp_compiled_matches_eager_on_gloo():
    results = run_on_gloo(4, _hsdp_step, timeout=300)
    for rank, res in enumerate(results):
        assert res["loss_diff"] <= 1e-6, (rank, res["loss_diff"])
        assert res["max_rel"] <= 1e-5, (rank, res["max_rel"])
        fx = [r for r in res["reports"] if r[1] == "fx"]
        assert fx and all(r[4] is None for r in res["reports"]), res["reports"]
        # the backward's reduce-scatters and replicate all-reduces were bucketed
        assert any(after < before for _, _, before, after, _ in fx)


def _consistency(rank: int, world_size: int) -> dict:
    import fsdp_passes
    from fsdp_passes.testing import build_mlp, capture_scheduler_nodes

    out = {}
    per_rank = {
        "same": [dict(bucketing="manual", bucket_plan=["layers.[0-1]"], memory_budget="1GB")] * 2,
        "different": [dict(bucketing="manual", bucket_plan=["layers.[0-1]"], memory_budget="1GB"),
                      dict(bucketing="none")],
    }
    for case, options in per_rank.items():
        model = build_mlp(2, 32)
        fsdp_passes.last_reports(clear=True)
        capture_scheduler_nodes(model, *example_inputs(model, seed=rank), options=dict(strict=True, **options[rank]))
        try:
            fsdp_passes.verify_rank_consistency()
            out[case] = None
        except RuntimeError as exc:
            out[case] = str(exc)
    return out


def test_verify_rank_consistency_on_gloo():
    results = run_on_gloo(2, _consistency, timeout=300)
    for res in results:
        assert res["same"] is None
        message = res["different"]
        assert message is not None
        assert "fwd" in message and "graph" in message  # names the first differing graph (the forward)
        assert "all_gather" in message and "rank 0" in message and "rank 1" in message


def test_verify_rank_consistency_needs_a_process_group():
    import fsdp_passes

    with pytest.raises(RuntimeError, match="not initialised"):
        fsdp_passes.verify_rank_consistency()
