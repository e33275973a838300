"""Compiled code every rank can share: with ``data_parallel``'s padded shards, two gloo ranks that share one
Inductor cache directory compile the same graphs (same FX graph cache keys, same planned collectives), and a
second run in new processes is served from the cache and trains the same.

The vocabulary (67 rows) does not divide by the world size (2): unpadded shards would have 34 and 33 rows.
"""

from __future__ import annotations

from fsdp_passes.testing import run_on_gloo

LLAMA = dict(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=67, seq_len=8)


def _run(rank: int, world_size: int, cache_dir: str) -> dict:
    import logging
    import os
    import re
    import time

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    import torch
    import torch._dynamo
    import torch._inductor.config as ic
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import fsdp_passes
    from fsdp_passes.testing import build_llama

    ic.fx_graph_cache = True  # the cache under test; AOTAutograd's own cache off, so hits are FX graph hits
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.reset()
    counters.clear()

    keys: list[str] = []

    class Keys(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            m = re.match(r"fx graph cache (hit|miss) for key (\S+)", record.getMessage())
            if m:
                keys.append(m.group(2))

    logger = logging.getLogger("torch._inductor.codecache")
    handler = Keys(level=logging.INFO)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    model = fsdp_passes.data_parallel(build_llama(**LLAMA, fsdp=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, fullgraph=True)
    g = torch.Generator().manual_seed(11 + rank)
    losses, step_s = [], []
    fsdp_passes.enable(bucketing="auto", reorder=True, memory_budget="50%", strict=True)
    try:
        for _ in range(2):
            tokens = torch.randint(0, LLAMA["vocab"], (2, LLAMA["seq_len"] + 1), generator=g)
            start = time.perf_counter()
            loss = F.cross_entropy(compiled(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            step_s.append(time.perf_counter() - start)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        reports = fsdp_passes.last_reports()
        fsdp_passes.verify_rank_consistency()  # raises if the ranks planned different collective sequences
    finally:
        fsdp_passes.disable()
        logger.removeHandler(handler)
    return {
        "losses": losses,
        "first_step_s": step_s[0],
        "hits": counters["inductor"]["fxgraph_cache_hit"],
        "misses": counters["inductor"]["fxgraph_cache_miss"],
        "bypasses": counters["inductor"]["fxgraph_cache_bypass"],
        "keys": keys,
        "fingerprints": sorted((r.graph, r.pass_name, r.collective_fingerprint) for r in reports),
    }


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


def test_two_ranks_share_one_cache_cold_then_warm(tmp_path):
    cache = _cold_fx_cache(tmp_path)
    cold = run_on_gloo(2, _run, cache, timeout=900)
    warm = run_on_gloo(2, _run, cache, timeout=900)
    for rank in range(2):
        c, w = cold[rank], warm[rank]
        assert c["bypasses"] == 0 and c["misses"] >= 2 and len(c["keys"]) >= 2, c
        assert w["hits"] >= 2 and w["misses"] == 0, w  # forward and backward served from the shared cache
        assert w["keys"] == c["keys"] and w["losses"] == c["losses"], (c, w)
    # both ranks compiled the same graphs: same cache keys, same collectives planned by the passes
    assert cold[0]["keys"] == cold[1]["keys"]
    assert cold[0]["fingerprints"] and cold[0]["fingerprints"] == cold[1]["fingerprints"]
    print("first step (compile + run) cold / warm, s:", [(round(c["first_step_s"], 2), round(w["first_step_s"], 2))
                                                         for c, w in zip(cold, warm)])
