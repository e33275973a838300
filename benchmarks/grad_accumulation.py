"""Gradient accumulation on the emulated two-node cluster: reducing every micro-batch against skipping the sync.

Same emulated cluster as ``emulated_cluster.py`` (two network namespaces, a veth pair capped by ``tc tbf``,
one gloo rank per namespace, one compute thread each).  A step is ``--micro-batches`` forward + backward
passes of the ``data_parallel`` MLP (reshard after forward, loss ``mean(model(x)**2) / micro-batches``, no
optimizer), timed under four configurations alternated step by step:

    eager_sync_every     eager, every micro-batch reduce-scatters its gradients
    eager_sync_last      eager, set_requires_gradient_sync(False) on all but the last micro-batch
    compiled_sync_every  torch.compile with fsdp_passes.enable(bucketing="auto", reorder=True, the link's profile)
    compiled_sync_last   the same with the sync skipped on all but the last micro-batch

After the timed steps each configuration runs one more step under ``torch.profiler`` to count the
reduce-scatters that reached the process group, and the accumulated gradients of every configuration are
compared with the first one's.

    sudo python benchmarks/grad_accumulation.py       # -> benchmarks/results/grad_accumulation.json
    sudo python benchmarks/grad_accumulation.py --smoke --out /tmp/grad_accumulation_smoke.json

Needs root, ``ip`` and ``tc``; the namespaces are deleted on every exit path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import emulated_cluster as ec  # benchmarks/ is this script's folder, so it is on sys.path

DEFAULT_OUT = ec.REPO / "benchmarks" / "results" / "grad_accumulation.json"
CONFIGS = ("eager_sync_every", "eager_sync_last", "compiled_sync_every", "compiled_sync_last")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="400mbit", help="tbf rate of each veth end (tc syntax), default 400mbit")
    p.add_argument("--layers", type=int, default=8, help="MLP blocks (default 8)")
    p.add_argument("--dim", type=int, default=512, help="model width (default 512)")
    p.add_argument("--hidden", type=int, default=1024, help="MLP hidden width (default 1024)")
    p.add_argument("--micro-batch", type=int, default=448, help="rows per rank per micro-batch (default 448)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per configuration (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first (default 2)")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 steps (quick check)")
    p.add_argument("--out", default=None, help=f"JSON output (default {DEFAULT_OUT.relative_to(ec.REPO)})")
    p.add_argument("--prefix", default="fsdpacc", help="namespace name prefix (default fsdpacc)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the ranks are killed")
    p.add_argument("--cache-dir", default=None, help="Inductor cache directory (reused between runs)")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--params-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.dim, args.hidden, args.micro_batch = 2, 64, 128, 16
        args.steps, args.warmup = 2, 1
    if args.micro_batches < 2:
        p.error(f"--micro-batches={args.micro_batches}; accumulation needs at least 2")
    if args.timeout is None:
        args.timeout = 400.0 if args.smoke else 3600.0
    return args


# ==================================================================================================
# Launcher
# ==================================================================================================

def launch(args: argparse.Namespace) -> int:
    return ec.run_two_ranks(args, name="grad_accumulation", script=Path(__file__), default_out=DEFAULT_OUT,
                            summarize=summarize, print_table=print_table)


def summarize(args: argparse.Namespace, ranks: list[dict]) -> dict:
    r0 = ranks[0]
    configs = {}
    for name in CONFIGS:
        times = [max(a, b) for a, b in zip(ranks[0]["times"][name], ranks[1]["times"][name])]  # the slower rank
        configs[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                         "times_s": times, "reduce_scatters_per_step": r0["reduce_scatters"][name],
                         "max_rel_grad_vs_eager_sync_every": max(r["max_rel_grad"][name] for r in ranks),
                         "warmup_s": r0["warmup_s"][name], "dynamo_graphs": r0["dynamo_graphs"][name]}
    speedup = {kind: configs[f"{kind}_sync_every"]["median_s"] / configs[f"{kind}_sync_last"]["median_s"]
               for kind in ("eager", "compiled")}
    return {"machine": r0["machine"], "model": r0["model"], "smoke": args.smoke, "steps": args.steps,
            "configs": configs, "speedup_sync_every_over_sync_last": speedup,
            "fsdp_passes_options": r0["fsdp_passes_options"]}


def print_table(s: dict) -> None:
    print(f"\n{'configuration':<22}{'median s':>10}{'min s':>8}{'max s':>8}{'RS/step':>9}{'grad rel':>10}")
    for name, c in s["configs"].items():
        print(f"{name:<22}{c['median_s']:>10.3f}{c['min_s']:>8.3f}{c['max_s']:>8.3f}"
              f"{c['reduce_scatters_per_step']:>9}{c['max_rel_grad_vs_eager_sync_every']:>10.1e}")
    for kind, ratio in s["speedup_sync_every_over_sync_last"].items():
        print(f"{kind}: sync every micro-batch / sync the last only = {ratio:.2f}x")


# ==================================================================================================
# Rank
# ==================================================================================================

def rank_main(args: argparse.Namespace) -> int:
    return ec.rank_entry(args, ("layers", "dim", "hidden", "micro_batch", "micro_batches", "steps", "warmup",
                                "rate"), _benchmark)


def _benchmark(args: argparse.Namespace, rank: int) -> dict:
    import contextlib
    from collections import Counter

    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import fsdp_passes
    from fsdp_passes.testing import build_mlp

    gen = torch.Generator().manual_seed(1000 + rank)
    xs = [torch.randn(args.micro_batch, args.dim, generator=gen) for _ in range(args.micro_batches)]
    latency_us = ec._measure_link_latency_us()
    box = [(ec._measure_gflops(), latency_us) if rank == 0 else None]  # both ranks plan with rank 0's profile
    dist.broadcast_object_list(box, src=0)
    options = dict(bucketing="auto", reorder=True, cluster=ec._link_profile(args.rate, *box[0]))

    def make(name: str) -> tuple[Any, Callable[[], None], Callable[[], Any]]:
        model = fsdp_passes.data_parallel(build_mlp(args.layers, args.dim, hidden=args.hidden, fsdp=False))
        compiled, sync_last = name.startswith("compiled"), name.endswith("sync_last")

        def loss_fn(inp: torch.Tensor) -> torch.Tensor:
            return model(inp).square().mean() / len(xs)

        if compiled:  # its own code object, so its own Dynamo cache (see emulated_cluster.py)
            loss_fn.__code__ = loss_fn.__code__.replace(co_name=f"loss_{name}")
        fn = torch.compile(loss_fn) if compiled else loss_fn

        def step() -> None:
            for p in model.parameters():
                p.grad = None
            for i, x in enumerate(xs):
                model.set_requires_gradient_sync(not sync_last or i == len(xs) - 1)
                fn(x).backward()

        return model, step, (lambda: fsdp_passes.enabled(**options)) if compiled else contextlib.nullcontext

    made = {name: make(name) for name in CONFIGS}
    warmup_s: dict[str, float] = {}
    graphs: dict[str, int] = {}
    for name, (_, step, context) in made.items():  # warm-up (compiles) one configuration at a time
        before, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        with context():
            for _ in range(args.warmup):
                dist.barrier()
                step()
        warmup_s[name], graphs[name] = time.perf_counter() - t0, counters["stats"]["unique_graphs"] - before
        print(f"rank {rank}: {name} warmed up in {warmup_s[name]:.1f} s", flush=True)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for i in range(args.steps):
        k = i % len(CONFIGS)
        for name in CONFIGS[k:] + CONFIGS[:k]:  # round robin, rotating which configuration goes first
            _, step, context = made[name]
            with context():
                dist.barrier()
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
        if rank == 0:
            print(f"step {i}: " + ", ".join(f"{n} {t[-1]:.3f}s" for n, t in times.items()), flush=True)
    reduce_scatters: dict[str, int] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for name, (model, step, context) in made.items():
        with context(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            dist.barrier()
            step()
        names = Counter(e.name for e in prof.events())
        reduce_scatters[name] = sum(c for n, c in names.items() if n.startswith("c10d::reduce_scatter"))
        grads[name] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    first = grads[CONFIGS[0]]
    max_rel = {name: max(((g[n] - first[n]).norm() / first[n].norm()).item() for n in first)
               for name, g in grads.items()}
    return {"rank": rank, "times": times, "reduce_scatters": reduce_scatters, "max_rel_grad": max_rel,
            "warmup_s": warmup_s, "dynamo_graphs": graphs, "machine": ec._machine(),
            "fsdp_passes_options": {k: v for k, v in options.items() if k != "cluster"} | {"cluster": "link"},
            "model": {"kind": "MLP (fsdp_passes.testing.build_mlp) under data_parallel, fp32, reshard after "
                              "forward", "layers": args.layers, "dim": args.dim, "hidden": args.hidden,
                      "micro_batch": args.micro_batch, "micro_batches": args.micro_batches,
                      "loss": "mean(model(x)**2) / micro_batches, forward + backward, no optimizer"}}


def main(argv: list[str] | None = None) -> int:
    return ec.dispatch(parse_args(argv), rank_main, launch)


if __name__ == "__main__":
    sys.exit(main())
