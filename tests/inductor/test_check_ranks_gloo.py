"""``enable(check_ranks=True)`` on a real 2-rank gloo group:

* ranks with different options (bucketing "auto" on rank 0, "none" on rank 1: different all-gathers) both
  raise ``RankMismatch`` naming the graph, the process group and the first differing collective on each rank,
  at the first run of the first graph, before any collective: the run finishes in bounded time;
* a rank whose peer never reaches the check raises after ``check_ranks_timeout_s``;
* agreeing ranks train 3 steps with the check on, losses and gradients bitwise equal to the check off.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fsdp_passes.testing import build_mlp, run_on_gloo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import fresh_compile_state  # noqa: E402


def _diverging(rank: int, world_size: int) -> dict:
    import torch

    import fsdp_passes

    fresh_compile_state()
    model = build_mlp(n_layers=3, dim=32)
    # rank 0 buckets its all-gathers, rank 1 does not: their first graphs issue different all-gathers
    fsdp_passes.enable(bucketing="auto" if rank == 0 else "none", cluster="cpu-gloo", memory_budget="100%",
                       check_ranks=True, check_ranks_timeout_s=600)
    compiled = torch.compile(model)
    start = time.monotonic()
    try:
        compiled(torch.randn(4, 32)).sum().backward()
    except fsdp_passes.RankMismatch as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    finally:
        fsdp_passes.disable()
    return {"error": None, "seconds": time.monotonic() - start}


def test_diverging_options_raise_on_both_ranks():
    # found at once (both ranks are blocked in the check), not after the check's 600 s timeout: run_on_gloo
    # raises TimeoutError after 240 s
    out = run_on_gloo(2, _diverging, timeout=240)
    for rank, got in enumerate(out):
        assert got["error"] is not None, f"rank {rank} ran without an error"
        text = got["error"]
        peer = 1 - rank
        assert f"ranks {rank} and {peer} compiled graphs that issue different collectives" in text, text
        assert "graph '000_fwd" in text and "process group '0'" in text, text
        assert f"on rank {rank} but" in text and f"on rank {peer}." in text, text
        assert "all_gather" in text and "fsdp_passes options" in text, text
        print(f"rank {rank}: {text}")


def _never_arrives(rank: int, world_size: int) -> dict:
    import torch

    import fsdp_passes

    fresh_compile_state()
    model = build_mlp(n_layers=2, dim=16)
    fsdp_passes.enable(check_ranks=True, check_ranks_timeout_s=5, cluster="cpu-gloo")
    compiled = torch.compile(model)
    start = time.monotonic()
    try:
        if rank == 0:  # rank 1 never runs the compiled model (it runs nothing that would meet rank 0)
            compiled(torch.randn(4, 16)).sum().backward()
        return {"error": None, "seconds": time.monotonic() - start}
    except fsdp_passes.RankMismatch as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    finally:
        fsdp_passes.disable()


def test_rank_that_never_arrives_is_an_error_after_the_timeout():
    out = run_on_gloo(2, _never_arrives, timeout=240)
    assert out[1]["error"] is None
    text, seconds = out[0]["error"], out[0]["seconds"]
    assert text is not None and "waited 5 s" in text and "for rank 1" in text and "never arrived" in text, text
    assert 5 <= seconds < 60, seconds


def _agreeing(rank: int, world_size: int) -> dict:
    import torch

    import fsdp_passes

    out = {}
    for check in (False, True):
        fresh_compile_state()
        model = build_mlp(n_layers=3, dim=32)
        fsdp_passes.enable(bucketing="auto", cluster="cpu-gloo", memory_budget="100%", check_ranks=check,
                           check_ranks_timeout_s=120)
        compiled = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(7 + rank)
        losses = []
        for _ in range(3):
            loss = compiled(torch.randn(4, 32, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        fsdp_passes.disable()
        from fsdp_passes.inductor.install import rank_checker

        out[f"checked_{check}"] = rank_checker().checked
        out[check] = {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return {
        "losses_off": out[False]["losses"],
        "losses_on": out[True]["losses"],
        "checked": out["checked_True"],
        "params_equal": all(torch.equal(out[True]["params"][n], p) for n, p in out[False]["params"].items()),
    }


def test_agreeing_ranks_train_as_without_the_check():
    out = run_on_gloo(2, _agreeing, timeout=400)
    for got in out:
        assert got["losses_on"] == got["losses_off"], got
        assert got["params_equal"], got
        assert got["checked"] == 2, got  # the forward and the backward graph were checked
