"""Frozen parameters (``requires_grad=False``, as in LoRA-style fine-tuning) under ``data_parallel`` on a real
2-rank gloo group: they are gathered but never reduced, keep their values, and the rest trains like the
unsharded model with the same parameters frozen, eager and compiled with the passes."""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp_passes.testing import run_on_gloo

# the shared helpers live in tests/ (test modules are imported by path, not as a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import fresh_compile_state, max_rel, token_batches, train_adamw  # noqa: E402

VOCAB = 67
LLAMA = dict(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=VOCAB, seq_len=8)
STEPS = 3
GLOBAL_BATCH = 4


def _frozen(name: str) -> bool:
    return ".attention." in name or name.startswith("tok_embeddings.")


def _model():
    from fsdp_passes.testing import build_llama

    model = build_llama(**LLAMA, fsdp=False)
    for name, p in model.named_parameters():
        p.requires_grad_(not _frozen(name))
    return model


def _batches(n_ranks: int, rank: int) -> list:
    return token_batches(STEPS, GLOBAL_BATCH, VOCAB, LLAMA["seq_len"], 3, n_ranks, rank)


def _frozen_run(rank: int, world_size: int) -> dict:
    import torch

    import fsdp_passes

    reference = _model()
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    train_adamw(reference, reference, _batches(1, 0))
    ref = {n: p.detach() for n, p in reference.named_parameters()}
    out: dict = {"trainable": sorted(n for n, p in reference.named_parameters() if p.requires_grad)}
    for name, compiled in (("eager", False), ("compiled", True)):
        model = fsdp_passes.data_parallel(_model())
        fresh_compile_state()
        fsdp_passes.last_reports(clear=True)
        if compiled:
            fsdp_passes.enable(bucketing="auto", reorder=True, memory_budget="50%", strict=True)
        try:
            train_adamw(model, torch.compile(model, fullgraph=True) if compiled else model,
                        _batches(world_size, rank))
        finally:
            fsdp_passes.disable()
        got = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        backward = [r for r in fsdp_passes.last_reports() if r.pass_name == "fx" and "bwd" in r.graph]
        out[name] = {
            "max_rel": max_rel(got, ref),
            "frozen_unchanged": all(torch.equal(got[n], initial[n]) for n in got if _frozen(n)),
            "frozen_without_grad": all(p.grad is None for n, p in model.named_parameters() if _frozen(n)),
            # the parameters the backward reduce-scatters (per member of every planned bucket)
            "reduced": sorted(param for r in backward for b in r.extra["bucketing"]["buckets"]
                              if b["op"] == "reduce_scatter" for param in b["params"]),
            "fallbacks": [r.fallback for r in fsdp_passes.last_reports() if r.fallback],
        }
    return out


def test_frozen_parameters_are_gathered_not_reduced_and_the_rest_trains():
    for rank, res in enumerate(run_on_gloo(2, _frozen_run, timeout=900)):
        assert res["trainable"] and len(res["trainable"]) < 12, res["trainable"]  # some frozen, some not
        for name in ("eager", "compiled"):
            got = res[name]
            assert got["max_rel"] <= 1e-5, (rank, name, got["max_rel"])
            assert got["frozen_unchanged"] and got["frozen_without_grad"], (rank, name)
        # compiled: one reduce-scatter per trainable parameter, none for a frozen one
        assert res["compiled"]["reduced"] == res["trainable"], (rank, res["compiled"]["reduced"])
        assert not res["compiled"]["fallbacks"], (rank, res["compiled"]["fallbacks"])
