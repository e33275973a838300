"""Real 2-rank gloo group, one spawned run shared by the tests of this module (spawning, importing torch and
the first compile are paid once):

* the compiled SimpleFSDP model with the passes matches eager and the unplanned compiled model: loss bitwise,
  gradients within 1e-6 relative (bitwise in fp32 across planners).  The configurations isolate each pass and
  combine them: reordering alone, bucketing alone (auto, no reordering) and both (a manual per-layer plan with
  reordering); the compile without the passes is itself checked against eager (loss bitwise, gradients within
  1e-6).
* ``verify_rank_consistency`` passes when both ranks planned the same collectives and names the first
  differing graph when they did not.

The rank functions compare on the rank and return plain values: tensors do not survive the trip out of a
finished spawned process.
"""

from __future__ import annotations

import pytest

from fsdp_passes.testing import build_mlp, example_inputs, run_on_gloo

CONFIGS = {
    "compiled": None,
    "reorder_only": {"bucketing": "none", "reorder": True},
    "bucketing_only": {"bucketing": "auto", "reorder": False, "memory_budget": "50%", "cluster": "cpu-gloo"},
    "manual": {"bucketing": "manual", "bucket_plan": ["layers.[0-2]"], "reorder": True, "memory_budget": "100%"},
}


def _step(rank: int, world_size: int) -> dict:
    import torch._dynamo
    import torch._inductor.config as ic
    from torch._dynamo.utils import counters

    import fsdp_passes

    ic.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch.manual_seed(1234 + rank)
    x = torch.randn(8, 32)
    out = {}
    for name in ["eager", *CONFIGS]:
        model = build_mlp(n_layers=3, dim=32, reshard_after_forward=True)
        torch._dynamo.reset()
        counters.clear()
        fsdp_passes.last_reports(clear=True)
        if name == "eager":
            fn = model
        else:
            options = CONFIGS[name]
            if options is None:
                fsdp_passes.disable()
            else:
                fsdp_passes.enable(strict=True, **options)
            fn = torch.compile(model)
        loss = fn(x).square().mean()
        loss.backward()
        fsdp_passes.disable()
        reports = fsdp_passes.last_reports()
        out[name] = {
            "loss": loss.detach(),
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
            "graphs": counters["stats"]["unique_graphs"],
            "collectives": [(r.graph, r.pass_name, r.n_collectives_before, r.n_collectives_after) for r in reports],
            "fallbacks": [r.fallback for r in reports if r.fallback],
            "gathers_moved": sum(r.extra.get("bucketing", {}).get("gathers_ahead_of_reductions", 0) for r in reports),
        }
    # compare here and return plain values: tensors do not survive the trip out of a finished process
    eager = out["eager"]
    summary = {}
    for name in CONFIGS:
        got = out[name]
        summary[name] = {
            "loss_bitwise": bool(torch.equal(got["loss"], eager["loss"])),
            "max_rel_vs_eager": max(
                ((got["grads"][p] - g).norm() / g.norm().clamp_min(1e-30)).item() for p, g in eager["grads"].items()
            ),
            "grads_bitwise_vs_compiled": all(
                torch.equal(got["grads"][p], out["compiled"]["grads"][p]) for p in eager["grads"]
            ),
            "graphs": got["graphs"],
            "collectives": got["collectives"],
            "fallbacks": got["fallbacks"],
            "gathers_moved": got["gathers_moved"],
        }
    return summary


# -- rank consistency -----------------------------------------------------------------------------------------

def _consistency(rank: int, world_size: int) -> dict:
    import fsdp_passes
    from fsdp_passes.testing import capture_scheduler_nodes

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


# -- one spawned run for both -------------------------------------------------------------------------------

def _all(rank: int, world_size: int) -> dict:
    return {"numerics": _step(rank, world_size), "consistency": _consistency(rank, world_size)}


@pytest.fixture(scope="module")
def gloo_results() -> list[dict]:
    return run_on_gloo(2, _all, timeout=900)


def test_passes_match_eager_and_unplanned_compile_on_gloo(gloo_results):
    results = [r["numerics"] for r in gloo_results]
    for rank, res in enumerate(results):
        for name in CONFIGS:
            got = res[name]
            assert got["graphs"] >= 1, (rank, name)  # Dynamo compiled the model (no silent eager fallback)
            assert got["loss_bitwise"], (rank, name)
            assert got["max_rel_vs_eager"] <= 1e-6, (rank, name, got["max_rel_vs_eager"])
            # bucketing only concatenates payloads: fp32 sums are bitwise those of the unplanned compile
            assert got["grads_bitwise_vs_compiled"], (rank, name)
            assert not got["fallbacks"], (rank, name, got["fallbacks"])
        # the passes really ran: bucketing cut the collective count in the FX pass of both graphs
        for name in ("bucketing_only", "manual"):
            fx = [c for c in res[name]["collectives"] if c[1] == "fx"]
            assert len(fx) == 2 and all(after < before for _, _, before, after in fx), (name, fx)
        assert any(c[1] == "scheduler" for c in res["reorder_only"]["collectives"])
        assert res["manual"]["gathers_moved"] > 0  # the backward re-gathers went ahead of reductions


def test_verify_rank_consistency_on_gloo(gloo_results):
    results = [r["consistency"] for r in gloo_results]
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
