"""``data_parallel`` on real gloo groups: training numerics against the unsharded model in one process.

A small Llama with a vocabulary (67 rows) that no world size here divides, so the embedding and output
weights are stored as padded shards.  The rank functions compare on the rank and return plain values (tensors
do not survive the trip out of a finished spawned process).  The tests share three spawned groups (see
``gloo_runs`` at the end).

Compiled code every rank can share: with the padded shards, two ranks that share one Inductor cache directory
compile the same graphs (same FX graph cache keys, same planned collectives), and a second run in new
processes is served from the cache and trains the same (unpadded shards of the vocabulary would have 34 and 33
rows).

bf16 parameters with fp32 reduction under the passes (bitwise equal to the compile without them):
tests/inductor/test_numerics_gloo.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fsdp_passes.testing import run_on_gloo

# the shared helpers live in tests/ (test modules are imported by path, not as a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import fresh_compile_state, max_rel, token_batches  # noqa: E402

VOCAB = 67
LLAMA = dict(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=VOCAB, seq_len=8)
STEPS = 5
GLOBAL_BATCH = 4
PASSES = dict(bucketing="auto", reorder=True, memory_budget="50%", strict=True)


def _batches(n_data_ranks: int, data_rank: int) -> list:
    """``STEPS`` global batches (token ids, targets); this rank's slice when ``n_data_ranks`` > 1."""
    return token_batches(STEPS, GLOBAL_BATCH, VOCAB, LLAMA["seq_len"], 7, n_data_ranks, data_rank)


def _train(model, fn, batches: list) -> tuple[list, object]:
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for tokens, targets in batches:
        loss = F.cross_entropy(fn(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, opt


def _reference() -> dict:
    """The unsharded model trained on the global batches, in this process."""
    from fsdp_passes.testing import build_llama

    model = build_llama(**LLAMA, fsdp=False)
    _train(model, model, _batches(1, 0))
    return {n: p.detach() for n, p in model.named_parameters()}


def _full_params(model) -> dict:
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def _padding_is_zero(model) -> bool:
    return all(bool((s.storage[s.info.local_rows:] == 0).all())
               for m in model.modules() for s in getattr(m, "_fsdp_shards", {}).values())


def _passes_summary(reports: list) -> dict:
    fx = [r for r in reports if r.pass_name == "fx"]
    return {"graphs": sorted({r.graph.split("_")[1] for r in reports}),
            "fallbacks": [r.fallback for r in reports if r.fallback],
            "merged": sum(r.n_collectives_before - r.n_collectives_after for r in fx)}


class _FxCacheWatch:
    """Inductor's FX graph cache on, in ``cache_dir`` (AOTAutograd's own cache stays off, so hits are FX graph
    hits), with the cache keys Inductor logs and its hit / miss / bypass counters, from here to ``summary``."""

    def __init__(self, cache_dir: str) -> None:
        import logging
        import os
        import re

        import torch._inductor.config as ic
        from torch._dynamo.utils import counters

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        ic.fx_graph_cache = True
        counters.clear()
        self.keys: list[str] = []
        keys = self.keys

        class Keys(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                m = re.match(r"fx graph cache (hit|miss) for key (\S+)", record.getMessage())
                if m:
                    keys.append(m.group(2))

        self.logger = logging.getLogger("torch._inductor.codecache")
        self.handler = Keys(level=logging.INFO)
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)

    def summary(self, losses: list, reports: list) -> dict:
        import torch._inductor.config as ic
        from torch._dynamo.utils import counters

        import fsdp_passes

        self.logger.removeHandler(self.handler)
        ic.fx_graph_cache = False
        fsdp_passes.verify_rank_consistency()  # raises if the ranks planned different collective sequences
        return {"losses": [loss.item() for loss in losses],
                "hits": counters["inductor"]["fxgraph_cache_hit"],
                "misses": counters["inductor"]["fxgraph_cache_miss"],
                "bypasses": counters["inductor"]["fxgraph_cache_bypass"],
                "keys": list(self.keys),
                "fingerprints": sorted((r.graph, r.pass_name, r.collective_fingerprint) for r in reports)}


def _fsdp_run(rank: int, world_size: int, cache_dir: str) -> dict:
    import torch

    import fsdp_passes
    from fsdp_passes.testing import build_llama

    ref = _reference()
    batches = _batches(world_size, rank)
    out = {}
    runs = {
        "compiled_reshard": dict(compiled=True, passes=PASSES, options=dict(reshard_after_forward=True)),
        "eager": dict(compiled=False, passes=None, options=dict(reshard_after_forward=True)),
        "compiled_keep_separate": dict(compiled=True, passes=PASSES,
                                       options=dict(reshard_after_forward=False, reduce_scatter_group="separate")),
    }
    for name, run in runs.items():
        model = fsdp_passes.data_parallel(build_llama(**LLAMA, fsdp=False), **run["options"])
        fresh_compile_state()
        fsdp_passes.last_reports(clear=True)
        if run["passes"]:
            fsdp_passes.enable(**run["passes"])
        # the first compile goes through the FX graph cache, cold: _warm_run compiles it again from the cache
        watch = _FxCacheWatch(cache_dir) if name == "compiled_reshard" else None
        fn = torch.compile(model, fullgraph=True) if run["compiled"] else model
        try:
            losses, opt = _train(model, fn, batches)
            if watch:
                out["cache_cold"] = watch.summary(losses, fsdp_passes.last_reports())
        finally:
            fsdp_passes.disable()
        # the optimizer sees the unpadded local shards: its states have their shapes
        opt_shapes_unpadded = all(opt.state[p][k].to_local().shape == p.to_local().shape
                                  for p in model.parameters() for k in ("exp_avg", "exp_avg_sq"))
        out[name] = {
            "max_rel": max_rel(_full_params(model), ref),
            "padding_zero": _padding_is_zero(model),
            "passes": _passes_summary(fsdp_passes.last_reports()),
            "rs_groups": sorted({(i.group_name, i.reduce_scatter_group_name)
                                 for i in fsdp_passes.frontend.sharded_params(model).values()}),
            "opt_shapes_unpadded": opt_shapes_unpadded,
            "padded_params": sum(i.local_rows != i.shard_shape[0]
                                 for i in fsdp_passes.frontend.sharded_params(model).values()),
        }
    return out


def _warm_run(rank: int, world_size: int, cache_dir: str) -> dict:
    """``compiled_reshard`` of :func:`_fsdp_run` again, in new processes, its graphs from the shared cache."""
    import torch

    import fsdp_passes
    from fsdp_passes.testing import build_llama

    model = fsdp_passes.data_parallel(build_llama(**LLAMA, fsdp=False), reshard_after_forward=True)
    fresh_compile_state()
    fsdp_passes.last_reports(clear=True)
    fsdp_passes.enable(**PASSES)
    watch = _FxCacheWatch(cache_dir)
    try:
        losses, _ = _train(model, torch.compile(model, fullgraph=True), _batches(world_size, rank))
        return watch.summary(losses, fsdp_passes.last_reports())
    finally:
        fsdp_passes.disable()


def test_fully_shard_trains_like_the_unsharded_model(gloo_runs):
    results = gloo_runs["fsdp"]
    for rank, res in enumerate(results):
        for name in ("compiled_reshard", "eager", "compiled_keep_separate"):
            got = res[name]
            assert got["max_rel"] <= 1e-5, (rank, name, got["max_rel"])
            assert got["padding_zero"] and got["opt_shapes_unpadded"], (rank, name)
            assert got["padded_params"] == 2 * rank, (rank, name)  # rank 1 pads embedding and output
        for name in ("compiled_reshard", "compiled_keep_separate"):
            passes = res[name]["passes"]
            assert passes["graphs"] == ["bwd", "fwd"] and not passes["fallbacks"], (rank, name, passes)
        # one group for gathers and reductions by default; a second group over the same ranks with "separate"
        (ag, rs), = res["compiled_reshard"]["rs_groups"]
        assert ag == rs
        (ag, rs), = res["compiled_keep_separate"]["rs_groups"]
        assert ag != rs


def _hybrid_run(rank: int, world_size: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_passes
    from fsdp_passes.testing import build_llama

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref = _reference()
    model = fsdp_passes.data_parallel(build_llama(**LLAMA, fsdp=False), mesh, mode="hybrid_shard")
    fresh_compile_state()
    fsdp_passes.enable(**PASSES)
    try:
        _train(model, torch.compile(model, fullgraph=True), _batches(world_size, rank))
    finally:
        fsdp_passes.disable()
    reports = fsdp_passes.last_reports()
    placements = {str(p.placements) for p in model.parameters()}
    return {"max_rel": max_rel(_full_params(model), ref), "padding_zero": _padding_is_zero(model),
            "passes": _passes_summary(reports), "placements": sorted(placements)}


def test_hybrid_shard_on_a_2x2_mesh_trains_like_the_unsharded_model(gloo_runs):
    results = gloo_runs["hybrid"]
    for rank, res in enumerate(results):
        assert res["max_rel"] <= 1e-5, (rank, res["max_rel"])
        assert res["padding_zero"], rank
        assert res["placements"] == ["(Replicate(), Shard(dim=0))"], res["placements"]
        assert res["passes"]["graphs"] == ["bwd", "fwd"] and not res["passes"]["fallbacks"], res["passes"]
        # bucketing merged collectives (the shard group's gathers / reduce-scatters, the replicate all-reduces)
        assert res["passes"]["merged"] > 0, res["passes"]


# -- checkpoints: save on 2 ranks, load on 4 and back -------------------------------------------------------

def _global_loss(loss):
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total)
    return (total / dist.get_world_size()).item()


def _eager_steps(model, opt, batches: list, steps: range) -> list[float]:
    import torch.nn.functional as F

    losses = []
    for i in steps:
        tokens, targets = batches[i]
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_global_loss(loss))
    return losses


def _checkpoint_phase(rank: int, world_size: int, folder: str, phase: str) -> dict:
    """A: 2 ranks train steps 0-4, saving sharded and full checkpoints after step 1.  B: 4 ranks load either
    checkpoint, train steps 2-3, save sharded.  C: 2 ranks load B's checkpoint and train step 4."""
    import os

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    import fsdp_passes
    from fsdp_passes.testing import build_llama

    def fresh(seed: int):
        model = fsdp_passes.data_parallel(build_llama(**LLAMA, fsdp=False, seed=seed))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def save_sharded(model, opt, name: str) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, name))

    def load_sharded(model, opt, name: str) -> None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(folder, name))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    batches = _batches(world_size, rank)
    out: dict = {}
    if phase == "A":
        model, opt = fresh(0)
        out["losses"] = _eager_steps(model, opt, batches, range(0, 2))
        save_sharded(model, opt, "after_step_1")
        full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, os.path.join(folder, "after_step_1_full.pt"))
        unsharded = build_llama(**LLAMA, fsdp=False).state_dict()
        out["full_shapes_unpadded"] = list(full[0]) == list(unsharded) and all(
            v.shape == unsharded[k].shape for k, v in full[0].items())
        out["losses"] += _eager_steps(model, opt, batches, range(2, STEPS))
    elif phase == "B":
        sharded, opt_s = fresh(1)  # other initial weights: the checkpoint must overwrite them
        load_sharded(sharded, opt_s, "after_step_1")
        full_model, opt_f = fresh(2)
        torch.distributed.barrier()
        msd, osd = torch.load(os.path.join(folder, "after_step_1_full.pt"), weights_only=False)
        set_state_dict(full_model, opt_f, model_state_dict=msd, optim_state_dict=osd,
                       options=StateDictOptions(full_state_dict=True))
        out["padding_zero_after_load"] = _padding_is_zero(sharded) and _padding_is_zero(full_model)
        out["losses_sharded"] = _eager_steps(sharded, opt_s, batches, range(2, 4))
        out["losses_full"] = _eager_steps(full_model, opt_f, batches, range(2, 4))
        save_sharded(sharded, opt_s, "after_step_3")
    else:
        model, opt = fresh(3)
        load_sharded(model, opt, "after_step_3")
        out["losses"] = _eager_steps(model, opt, batches, range(4, STEPS))
    return out


def test_checkpoint_save_on_2_ranks_load_on_4_and_back(gloo_runs):
    import math

    a, b, c = gloo_runs["checkpoint"]
    assert a["full_shapes_unpadded"]
    assert b["padding_zero_after_load"]
    close = lambda x, y: all(math.isclose(u, v, rel_tol=1e-5) for u, v in zip(x, y, strict=True))  # noqa: E731
    assert close(b["losses_sharded"], a["losses"][2:4]), (b, a)
    assert close(b["losses_full"], a["losses"][2:4]), (b, a)
    assert close(c["losses"], a["losses"][4:]), (c, a)


# -- compiled code every rank can share ---------------------------------------------------------------------

def test_two_ranks_share_one_cache_cold_then_warm(gloo_runs):
    cold = [r["cache_cold"] for r in gloo_runs["fsdp"]]
    warm = gloo_runs["cache_warm"]
    for rank in range(2):
        c, w = cold[rank], warm[rank]
        assert c["bypasses"] == 0 and c["misses"] >= 2 and len(c["keys"]) >= 2, c
        assert w["hits"] >= 2 and w["misses"] == 0, w  # forward and backward served from the shared cache
        assert w["keys"] == c["keys"] and w["losses"] == c["losses"], (c, w)
    # both ranks compiled the same graphs: same cache keys, same collectives planned by the passes
    assert cold[0]["keys"] == cold[1]["keys"]
    assert cold[0]["fingerprints"] and cold[0]["fingerprints"] == cold[1]["fingerprints"]


# -- the spawned runs, shared by the tests above ------------------------------------------------------------

def _cold_fx_cache(folder) -> str:
    """A cache directory without FX graph / AOTAutograd entries that reuses the session's compiled C++ kernels
    (links to every other entry of ``$TORCHINDUCTOR_CACHE_DIR``), so that "cold" costs a compile, not a
    rebuild of every kernel."""
    import os

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    cache = folder / "inductor"
    cache.mkdir()
    if base and os.path.isdir(base):
        for entry in os.listdir(base):
            if entry not in ("fxgraph", "aotautograd"):
                os.symlink(os.path.join(base, entry), cache / entry)
    return str(cache)


def _two_ranks_first(rank: int, world_size: int, folder: str, cache_dir: str) -> dict:
    return {"checkpoint": _checkpoint_phase(rank, world_size, folder, "A"),
            "fsdp": _fsdp_run(rank, world_size, cache_dir)}


def _four_ranks(rank: int, world_size: int, folder: str) -> dict:
    return {"checkpoint": _checkpoint_phase(rank, world_size, folder, "B"), "hybrid": _hybrid_run(rank, world_size)}


def _two_ranks_last(rank: int, world_size: int, folder: str, cache_dir: str) -> dict:
    return {"checkpoint": _checkpoint_phase(rank, world_size, folder, "C"),
            "cache_warm": _warm_run(rank, world_size, cache_dir)}


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory) -> dict:
    """Three spawned groups (2, 4, then 2 ranks) instead of one per test and checkpoint phase: the checkpoint
    phases A / B / C run in them in order, fully_shard (its first compile cold in a shared cache) beside A,
    hybrid shard beside B, the warm run of that cache beside C."""
    folder = str(tmp_path_factory.mktemp("checkpoints"))
    cache = _cold_fx_cache(tmp_path_factory.mktemp("cache"))
    first = run_on_gloo(2, _two_ranks_first, folder, cache, timeout=900)
    four = run_on_gloo(4, _four_ranks, folder, timeout=900)
    last = run_on_gloo(2, _two_ranks_last, folder, cache, timeout=900)
    return {"fsdp": [r["fsdp"] for r in first], "hybrid": [r["hybrid"] for r in four],
            "cache_warm": [r["cache_warm"] for r in last],
            "checkpoint": (first[0]["checkpoint"], four[0]["checkpoint"], last[0]["checkpoint"])}
