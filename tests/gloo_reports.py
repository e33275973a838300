"""Helpers shared by the gloo tests (imported by path, like the test modules)."""

from __future__ import annotations


def fresh_compile_state() -> None:
    import torch._dynamo
    import torch._inductor.config as ic

    ic.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.reset()


def compiled_with(model, options: dict | None):
    """``torch.compile(model)`` with the passes enabled (``strict``) by ``options``, or without them (None).
    The caller runs the step, then calls ``fsdp_passes.disable()``."""
    import torch

    import fsdp_passes

    if options is None:
        fsdp_passes.disable()
    else:
        fsdp_passes.enable(strict=True, **options)
    return torch.compile(model)


def token_batches(steps: int, global_batch: int, vocab: int, seq_len: int, seed: int, n_ranks: int = 1,
                  rank: int = 0) -> list:
    """``steps`` global batches of random (tokens, next tokens); this rank's slice of each when ``n_ranks`` > 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    per = global_batch // n_ranks
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
        part = tokens[rank * per:(rank + 1) * per]
        out.append((part[:, :-1], part[:, 1:]))
    return out


def train_adamw(model, fn, batches: list, weight_decay: float = 0.0, max_norm: float | None = None,
                norms: list | None = None, losses: list | None = None):
    """One AdamW step (lr 1e-2) per batch of ``token_batches`` on the cross entropy of ``fn(tokens)``; returns
    the optimizer.  Parameters without a gradient (frozen) are left alone, as AdamW does.  With ``max_norm``,
    the gradients are clipped to it first (``torch.nn.utils.clip_grad_norm_``), and each step's total norm
    before clipping is appended to ``norms`` if given; each step's loss (a float) to ``losses`` if given."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    for tokens, targets in batches:
        loss = F.cross_entropy(fn(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        if losses is not None:
            losses.append(loss.item())
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if norms is not None:
                norms.append(norm)
        opt.step()
        opt.zero_grad()
    return opt


def max_rel(got: dict, ref: dict) -> float:
    return max(((got[p] - g).norm() / g.norm().clamp_min(1e-30)).item() for p, g in ref.items())


def report_summary(reports: list) -> list[dict]:
    """The plain-value parts of ``fsdp_passes.last_reports()`` the tests look at."""
    out = []
    for r in reports:
        bucketing = r.extra.get("bucketing", {})
        out.append({
            "graph": r.graph,  # "000_fwd_frame0.0"
            "pass": r.pass_name,
            "before": r.n_collectives_before,
            "after": r.n_collectives_after,
            "fallback": r.fallback,
            "buckets": [{k: b[k] for k in ("op", "group", "dtype", "members")} for b in bucketing.get("buckets", [])],
            "unbucketed": dict(bucketing.get("unbucketed", {})),
            "sequence": [c.split() for c in r.extra.get("collective_sequence", [])],  # [op, group, bytes, dtype]
        })
    return out


def check_passes_ran(reports: list[dict], where: object) -> None:
    """Both passes ran on both graphs (forward, backward) and kept what they planned (no fallback)."""
    ran = {(r["graph"].split("_")[1], r["pass"]) for r in reports}
    assert ran == {("fwd", "fx"), ("bwd", "fx"), ("fwd", "scheduler"), ("bwd", "scheduler")}, (where, ran)
    assert all(r["fallback"] is None for r in reports), (where, [r["fallback"] for r in reports])
