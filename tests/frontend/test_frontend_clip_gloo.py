"""``torch.nn.utils.clip_grad_norm_`` on a ``data_parallel`` model on a real 2-rank gloo group, as with FSDP2:
parameters and gradients are ``Shard(0)`` DTensors (67 rows: padded on rank 1, the padding never counted), so
the total norm is the whole model's, on every rank.  Each step's norm and the trained parameters are compared
with the unsharded model clipped the same way in one process, eager and compiled with the passes."""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp_passes.testing import run_on_gloo

# the shared helpers live in tests/ (test modules are imported by path, not as a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import compiled_with, fresh_compile_state, max_rel, token_batches, train_adamw  # noqa: E402

VOCAB = 67
LLAMA = dict(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=VOCAB, seq_len=8)
STEPS = 3
GLOBAL_BATCH = 4
MAX_NORM = 0.25  # below every step's norm (asserted), so every step clips


def _model():
    from fsdp_passes.testing import build_llama

    return build_llama(**LLAMA, fsdp=False)


def _batches(n_ranks: int, rank: int) -> list:
    return token_batches(STEPS, GLOBAL_BATCH, VOCAB, LLAMA["seq_len"], 5, n_ranks, rank)


def _clip_run(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import DTensor, Replicate

    import fsdp_passes

    reference = _model()
    ref_norms: list = []
    train_adamw(reference, reference, _batches(1, 0), max_norm=MAX_NORM, norms=ref_norms)
    ref = {n: p.detach() for n, p in reference.named_parameters()}
    out: dict = {"reference_norms": [n.item() for n in ref_norms]}
    for name, options in (("eager", None), ("compiled", dict(bucketing="auto", reorder=True, memory_budget="50%"))):
        model = fsdp_passes.data_parallel(_model())
        fresh_compile_state()
        fsdp_passes.last_reports(clear=True)
        norms: list = []
        try:
            fn = model if options is None else compiled_with(model, options)
            train_adamw(model, fn, _batches(world_size, rank), max_norm=MAX_NORM, norms=norms)
        finally:
            fsdp_passes.disable()
        got = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        out[name] = {
            "replicated": all(isinstance(n, DTensor) and n.placements == (Replicate(),) for n in norms),
            "norms": [n.to_local().item() for n in norms],  # this rank's value of the norm
            "max_rel": max_rel(got, ref),
            "fallbacks": [r.fallback for r in fsdp_passes.last_reports() if r.fallback],
            "graphs": len(fsdp_passes.last_reports()),
        }
    return out


def test_clip_grad_norm_matches_the_unsharded_model():
    for rank, res in enumerate(run_on_gloo(2, _clip_run, timeout=900)):
        ref_norms = res["reference_norms"]
        assert len(ref_norms) == STEPS and min(ref_norms) > MAX_NORM, ref_norms  # every step clipped
        for name in ("eager", "compiled"):
            got = res[name]
            assert got["replicated"], (rank, name)
            assert len(got["norms"]) == STEPS, (rank, name, got["norms"])
            for step, (norm, expected) in enumerate(zip(got["norms"], ref_norms)):
                assert abs(norm - expected) <= 1e-5 * expected, (rank, name, step, norm, expected)
            assert got["max_rel"] <= 1e-5, (rank, name, got["max_rel"])
        assert res["compiled"]["graphs"] >= 2 and not res["compiled"]["fallbacks"], (rank, res["compiled"])
