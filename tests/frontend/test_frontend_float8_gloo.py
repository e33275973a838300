"""``data_parallel(float8_all_gather=True)`` on 2 gloo ranks: the gathered weights, and training.

A small Llama whose output weight (67 rows) is a padded shard.  The rank function compares on the rank and
returns plain values (floats, numpy arrays): tensors do not survive the trip out of a finished process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fsdp_passes.testing import run_on_gloo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import fresh_compile_state, token_batches, train_adamw  # noqa: E402

VOCAB = 67
LLAMA = dict(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=VOCAB, seq_len=8)
STEPS = 3
GLOBAL_BATCH = 4
PASSES = dict(bucketing="auto", reorder=True, strict=True)
#: float8 e4m3 keeps 3 mantissa bits: a scaled weight rounds to within 2**-4 of itself (relative), or, among
#: the subnormals, to within half their spacing 2**-9; scaled back, that is 2**-10 * amax / 448
E4M3_REL = 2.0 ** -4
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10
#: tolerance of the float8 run's losses against the bf16 run's (relative, each of the 3 steps): the gathered
#: weights move by up to 2**-4 of themselves; the losses moved by at most 1.5e-3 (docs/frontend.md)
LOSS_REL_TOL = 1e-2


def _worst_error_over_bound(got, want) -> float:
    """The largest error of float8-gathered rows ``got`` against ``want`` (one rank's shard, one scale), in
    units of the e4m3 rounding bound; numpy arrays."""
    import numpy as np

    bound = np.maximum(E4M3_REL * np.abs(want), E4M3_SUBNORMAL_HALF_STEP * np.abs(want).max() / 448)
    return float((np.abs(got - want) / bound).max())


#: Linear(4, 8) weights (4 rows a rank) with a special shard: rank 0's rows zero (a zero-initialised layer
#: such as a LoRA B, zeroed by rows), the whole weight zero, one inf or one NaN among rank 1's rows
SPECIAL_SHARDS = {
    "rank0_rows_zero": lambda w: w[:4].zero_(),
    "all_zero": lambda w: w.zero_(),
    "inf_on_rank1": lambda w: w[5, 2].fill_(float("inf")),
    "nan_on_rank1": lambda w: w[6, 1].fill_(float("nan")),
}


def _special_shards(rank: int, world_size: int) -> dict:
    """Each ``SPECIAL_SHARDS`` weight as set, and as gathered in float8 eagerly and compiled (numpy arrays)."""
    import torch
    import torch.nn as nn

    import fsdp_passes

    out = {}
    for case, fill in SPECIAL_SHARDS.items():
        torch.manual_seed(0)
        linear = nn.Linear(4, 8, bias=False)
        with torch.no_grad():
            fill(linear.weight)
        want = linear.weight.detach().clone()
        fsdp_passes.data_parallel(linear, float8_all_gather=True)
        with torch.no_grad():
            got = {"eager": linear.weight.numpy()}
            if case == "rank0_rows_zero":
                fresh_compile_state()
                got["compiled"] = torch.compile(lambda: linear.weight, fullgraph=True)().numpy()
        out[case] = {"want": want.numpy(), **got}
    return out


def _gathered_weights(rank: int, world_size: int) -> dict:
    """Each Linear weight gathered in float8 (float32 parameters, no param_dtype) against its own values."""
    import math

    import torch
    import torch.nn as nn

    import fsdp_passes
    from fsdp_passes.testing import build_llama

    model = fsdp_passes.data_parallel(build_llama(**LLAMA, fsdp=False), float8_all_gather=True)
    worst = 0.0
    exact = []
    with torch.no_grad():
        for mod in model.modules():
            if not isinstance(mod, nn.Linear):
                continue
            ref = mod._parameters["weight"].full_tensor()
            got = mod.weight  # the property: float8 all-gather, dequantised
            rows = math.ceil(ref.shape[0] / world_size)
            for r in range(world_size):  # each rank's rows were scaled by that rank's amax
                part, want = got[r * rows:(r + 1) * rows], ref[r * rows:(r + 1) * rows]
                if want.numel():
                    worst = max(worst, _worst_error_over_bound(part.numpy(), want.numpy()))
            exact.append(bool(torch.equal(got, ref)))
        output = model.output.weight.numpy()
    return {"worst_error_over_bound": worst, "any_exact": any(exact), "output": output}


def _training(rank: int, world_size: int) -> dict:
    import torch

    import fsdp_passes
    from fsdp_passes import MixedPrecisionPolicy
    from fsdp_passes.testing import build_llama

    batches = token_batches(STEPS, GLOBAL_BATCH, VOCAB, LLAMA["seq_len"], 7, world_size, rank)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = {"bf16": (False, True, None), "float8_eager": (True, False, None),
            "float8": (True, True, None), "float8_passes": (True, True, PASSES)}
    out: dict = {"gather": _gathered_weights(rank, world_size), "special": _special_shards(rank, world_size)}
    for name, (float8, compiled, passes) in runs.items():
        model = fsdp_passes.data_parallel(build_llama(**LLAMA, fsdp=False), mp_policy=policy,
                                          float8_all_gather=float8)
        fresh_compile_state()
        fsdp_passes.last_reports(clear=True)
        if passes:
            fsdp_passes.enable(**passes)
        try:
            losses: list[float] = []
            train_adamw(model, torch.compile(model, fullgraph=True) if compiled else model, batches, losses=losses)
        finally:
            fsdp_passes.disable()
        reports = fsdp_passes.last_reports(clear=True)
        fx = [r for r in reports if r.pass_name == "fx"]
        out[name] = {
            "losses": losses,
            "params": {n: p.to_local().detach().numpy().copy() for n, p in model.named_parameters()},
            "fallbacks": [r.fallback for r in reports if r.fallback],
            "merged": sum(r.n_collectives_before - r.n_collectives_after for r in fx),
            "uint8_buckets": sum(1 for r in fx for b in r.extra["bucketing"]["buckets"]
                                 if b["dtype"] == "uint8" and len(b["members"]) > 1),
        }
    return out


@pytest.fixture(scope="module")
def results() -> list:
    return run_on_gloo(2, _training, timeout=600)


def test_gathered_float8_weights_round_within_e4m3_precision(results):
    import numpy as np

    for rank, res in enumerate(results):
        g = res["gather"]
        assert g["worst_error_over_bound"] <= 1.0, (rank, g["worst_error_over_bound"])
        assert not g["any_exact"], rank  # the weights did go through float8
    # every rank dequantised the same bytes with the same scales
    assert np.array_equal(results[0]["gather"]["output"], results[1]["gather"]["output"])


def test_float8_training_is_within_tolerance_of_bf16(results):
    for rank, res in enumerate(results):
        for f8, bf16 in zip(res["float8"]["losses"], res["bf16"]["losses"]):
            assert abs(f8 - bf16) <= LOSS_REL_TOL * abs(bf16), (rank, res["float8"]["losses"], res["bf16"]["losses"])
        assert res["float8"]["losses"] != res["bf16"]["losses"], rank  # float8 did change the numbers


def test_float8_with_the_passes_equals_without(results):
    import numpy as np

    for rank, res in enumerate(results):
        got, want = res["float8_passes"], res["float8"]
        assert not got["fallbacks"] and got["merged"] > 0 and got["uint8_buckets"] > 0, (rank, got)
        assert got["losses"] == want["losses"], (rank, got["losses"], want["losses"])
        for name, value in want["params"].items():
            assert np.array_equal(got["params"][name], value), (rank, name)


def test_float8_compiled_matches_eager(results):
    for rank, res in enumerate(results):
        for c, e in zip(res["float8"]["losses"], res["float8_eager"]["losses"]):
            assert abs(c - e) <= 1e-3 * abs(e), (rank, res["float8"]["losses"], res["float8_eager"]["losses"])


def test_an_all_zero_shard_comes_back_as_zeros_and_the_others_as_usual(results):
    import numpy as np

    for case in ("rank0_rows_zero", "all_zero"):
        for rank, res in enumerate(results):
            special = res["special"][case]
            want = special["want"]
            for how in ("eager", "compiled") if "compiled" in special else ("eager",):
                got = special[how]
                assert np.isfinite(got).all(), (case, rank, how, got)
                assert np.array_equal(got[:4], np.zeros_like(got[:4])), (case, rank, how, got)
                if want[4:].any():
                    assert _worst_error_over_bound(got[4:], want[4:]) <= 1.0, (case, rank, how, got, want)
                assert np.array_equal(got, results[0]["special"][case]["eager"]), (case, rank, how)


def test_an_inf_or_nan_in_a_shard_makes_that_ranks_rows_nan_on_every_rank(results):
    import numpy as np

    for case in ("inf_on_rank1", "nan_on_rank1"):
        for rank, res in enumerate(results):
            got, want = res["special"][case]["eager"], res["special"][case]["want"]
            assert np.isnan(got[4:]).all(), (case, rank, got)  # rank 1's rows: not hidden, not a finite value
            assert _worst_error_over_bound(got[:4], want[:4]) <= 1.0, (case, rank, got, want)  # rank 0's: as usual
            assert np.array_equal(got, results[0]["special"][case]["eager"], equal_nan=True), (case, rank)
