"""``data_parallel`` with a tied parameter (the output projection is the embedding) on a real 2-rank gloo group:
training numerics against the unsharded tied model in one process, eager and compiled with the passes.

The tied weight is one ``nn.Parameter`` for both owners, sharded once (67 rows: padded on rank 1); each owner
gathers it where it reads it, and the two gradient contributions are summed before the optimizer sees them.
A sharding that kept two copies, or dropped one contribution, trains a different model.  The trained model
goes through a torch.distributed.checkpoint save and load into a fresh tied model."""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp_passes.testing import run_on_gloo

# the shared helpers live in tests/ (test modules are imported by path, not as a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import fresh_compile_state, max_rel, token_batches, train_adamw  # noqa: E402

VOCAB = 67
LLAMA = dict(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=VOCAB, seq_len=8)
STEPS = 4
GLOBAL_BATCH = 4


def _batches(n_ranks: int, rank: int) -> list:
    return token_batches(STEPS, GLOBAL_BATCH, VOCAB, LLAMA["seq_len"], 11, n_ranks, rank)


def _tied_llama(seed: int = 0):
    from fsdp_passes.testing import build_llama

    model = build_llama(**LLAMA, fsdp=False, seed=seed)
    model.output.weight = model.tok_embeddings.weight
    return model


def _checkpoint_round_trip(model, opt, folder: str) -> dict:
    """Save ``model`` and ``opt`` with torch.distributed.checkpoint, load them into a fresh tied model with
    other weights: the same parameters, still tied."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import fsdp_passes

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    fresh = fsdp_passes.data_parallel(_tied_llama(seed=1))
    fresh_opt = train_adamw(fresh, fresh, _batches(2, 0)[:1], weight_decay=0.1)  # optimizer state to load into
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {
        "equal": all(torch.equal(p.full_tensor(), q.full_tensor())
                     for p, q in zip(model.parameters(), fresh.parameters())),
        "tied": fresh.output._parameters["weight"] is fresh.tok_embeddings._parameters["weight"],
    }


def _tied_run(rank: int, world_size: int, folder: str) -> dict:
    import torch

    import fsdp_passes

    reference = _tied_llama()
    train_adamw(reference, reference, _batches(1, 0), weight_decay=0.1)
    ref = {n: p.detach() for n, p in reference.named_parameters()}
    out: dict = {"reference_names": sorted(ref)}
    for name, compiled in (("eager", False), ("compiled", True)):
        model = fsdp_passes.data_parallel(_tied_llama())
        fresh_compile_state()
        fsdp_passes.last_reports(clear=True)
        if compiled:
            fsdp_passes.enable(bucketing="auto", reorder=True, memory_budget="50%", strict=True)
        try:
            opt = train_adamw(model, torch.compile(model, fullgraph=True) if compiled else model,
                              _batches(world_size, rank), weight_decay=0.1)
            if compiled:
                fsdp_passes.verify_rank_consistency()
        finally:
            fsdp_passes.disable()
        got = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        out[name] = {
            "names": sorted(got),
            "max_rel": max_rel(got, ref),
            # still one parameter: the owners' attributes read the same trained values
            "tied": model.output._parameters["weight"] is model.tok_embeddings._parameters["weight"],
            "fallbacks": [r.fallback for r in fsdp_passes.last_reports() if r.fallback],
            "graphs": len(fsdp_passes.last_reports()),
        }
    out["checkpoint"] = _checkpoint_round_trip(model, opt, folder)
    return out


def test_a_tied_parameter_trains_like_the_unsharded_tied_model(tmp_path):
    results = run_on_gloo(2, _tied_run, str(tmp_path / "checkpoint"), timeout=900)
    for rank, res in enumerate(results):
        for name in ("eager", "compiled"):
            got = res[name]
            assert got["names"] == res["reference_names"], (rank, name)  # one name for the tied weight
            assert got["tied"], (rank, name)
            assert got["max_rel"] <= 1e-5, (rank, name, got["max_rel"])
        assert res["compiled"]["graphs"] >= 2 and not res["compiled"]["fallbacks"], (rank, res["compiled"])
        assert res["checkpoint"] == {"equal": True, "tied": True}, (rank, res["checkpoint"])
