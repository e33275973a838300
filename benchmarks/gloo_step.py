"""A compiled training step's wall time on two gloo ranks (loopback), for one or more checkouts of the package.

Each measurement is a fresh pair of processes (``fsdp_passes.testing.run_on_gloo``) importing ``fsdp_passes``
from one checkout: a Llama from ``fsdp_passes.testing.build_llama`` (sharded SimpleFSDP-style), compiled
with ``fsdp_passes.enable()`` defaults (or without the passes: ``--off``), a few warm-up steps, then timed
steps (forward, backward, an SGD update), each ended by a barrier so both ranks time the same step; the result
is the median over the slower rank's steps.  Checkouts alternate within each round (the order rotating) so
that a change in the machine's load falls on all of them: use it to tell whether a change to the passes
makes the step slower.

    python benchmarks/gloo_step.py --checkouts /path/to/old,/path/to/new --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent


def _rank(rank: int, world_size: int, layers: int, dim: int, steps: int, warmup: int, off: bool) -> list[float]:
    import torch
    import torch.distributed as dist

    import fsdp_passes
    from fsdp_passes.testing import build_llama, example_inputs

    model = build_llama(n_layers=layers, dim=dim, ffn_dim=4 * dim, n_heads=8, n_kv_heads=4, vocab=1024,
                        seq_len=128)
    (ids,) = example_inputs(model, batch=4, seed=rank)
    if not off:
        fsdp_passes.enable()
    compiled = torch.compile(model, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for k in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        compiled(ids).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if k >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    fsdp_passes.disable()
    return times


def child(args: argparse.Namespace) -> dict[str, Any]:
    from fsdp_passes.testing import run_on_gloo

    per_rank = run_on_gloo(2, _rank, args.layers, args.dim, args.steps, args.warmup, args.off, timeout=900)
    slower = [max(ts) for ts in zip(*per_rank)]
    import fsdp_passes

    return {"median_ms": statistics.median(slower), "min_ms": min(slower), "max_ms": max(slower),
            "fsdp_passes": str(Path(fsdp_passes.__file__).resolve().parent.parent)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkouts", default=str(BENCHMARKS.parent),
                   help="comma-separated checkout folders (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--off", action="store_true", help="compile without the passes")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="JSON output")
    args = p.parse_args()
    if args.child:  # fsdp_passes from the checkout on PYTHONPATH: nothing here puts another on sys.path
        print(json.dumps(child(args)))
        return
    sys.path.insert(0, str(BENCHMARKS))
    import _common as C
    checkouts = [str(Path(c).resolve()) for c in args.checkouts.split(",")]
    runs = []
    for k in range(args.rounds):
        for c in checkouts[k % len(checkouts):] + checkouts[:k % len(checkouts)]:
            argv = [sys.executable, __file__, "--child", "--layers", str(args.layers), "--dim", str(args.dim),
                    "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--off"] if args.off else [])
            load = os.getloadavg()[0]
            proc = subprocess.run(argv, env=dict(os.environ, PYTHONPATH=c), capture_output=True, text=True, cwd=c)
            if proc.returncode != 0:
                raise RuntimeError(f"{c}: child failed:\n{proc.stderr[-4000:]}")
            commit = subprocess.run(["git", "-C", c, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
            r = dict(json.loads(proc.stdout.strip().splitlines()[-1]), checkout=c, commit=commit, round=k,
                     load_before=load, load_after=os.getloadavg()[0])
            assert r["fsdp_passes"].startswith(c), (r["fsdp_passes"], c)
            runs.append(r)
            print(f"round {k} {c}: median {r['median_ms']:.1f} ms (min {r['min_ms']:.1f}, max {r['max_ms']:.1f}), "
                  f"load {r['load_before']:.1f}->{r['load_after']:.1f}", flush=True)
    summary = {c: statistics.median(r["median_ms"] for r in runs if r["checkout"] == c) for c in checkouts}
    for c, ms in summary.items():
        print(f"{c}: median of the rounds' medians {ms:.1f} ms")
    if args.out:
        C.write_json(Path(args.out), {"benchmark": "gloo_step", "machine": C.machine(), "argv": sys.argv[1:],
                                      "runs": runs, "summary_ms": summary})
        print(f"results: {args.out}")


if __name__ == "__main__":
    main()
