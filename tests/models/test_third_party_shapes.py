"""Per-group collective sequences of Inductor's final order do not depend on the local batch or sequence
length, on models this package did not write: GPT-2 sharded by torchtitan's SimpleFSDP frontend (uneven
251-token vocabulary, property-getter gathers) and Mixtral (grouped_mm experts) under ``data_parallel``; fake
8-rank group at rank 7, for default options and a strict per-block plan.
(The hand-sharded model's sweep over every option set: test_hand_sharded.py.)"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

import fsdp_passes
from fsdp_passes.testing import fake_process_group
from fsdp_passes.testing.end_to_end import measure_compile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_models  # noqa: E402
import third_party_models  # noqa: E402

SHAPES = [(2, 16), (1, 3), (3, 7), (4, 32), (8, 16)]


def _gpt2(world_size):
    return third_party_models.sharded_loss_module("gpt2", world_size)


def _mixtral(world_size):
    return moe_models.sharded_moe_loss("mixtral", world_size)


MODELS = {
    "gpt2-torchtitan": (_gpt2, third_party_models.PER_BLOCK_PLANS["gpt2"], third_party_models.VOCAB["gpt2"]),
    "mixtral-data_parallel": (_mixtral, moe_models.per_block_plan(), moe_models.VOCAB),
}
OPTIONS = {
    "defaults": dict(),
    "per-block-strict-1GB": "per-block",
}


@pytest.mark.parametrize("option_set", list(OPTIONS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_sequences_do_not_depend_on_the_local_shape(model_name, option_set):
    import torch

    make, plan, vocab = MODELS[model_name]
    options = OPTIONS[option_set]
    if options == "per-block":
        options = dict(bucketing="manual", bucket_plan=plan, strict=True, memory_budget="1GB")
    per_shape = {}
    with fake_process_group(world_size=8, rank=7):
        for batch, seq in SHAPES:
            ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))
            fsdp_passes.last_reports(clear=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # uneven shards
                measures = measure_compile(make(8), ids, options=options)
            assert not [r.fallback for r in fsdp_passes.last_reports() if r.fallback]
            per_shape[batch, seq] = {m.graph_name: m.sequences for m in measures}
    reference = per_shape[SHAPES[0]]
    assert set(reference) == {"forward", "backward"} and all(reference.values())
    for shape, sequences in per_shape.items():
        assert sequences == reference, f"{model_name} {option_set}: sequences at {shape} differ from {SHAPES[0]}"
