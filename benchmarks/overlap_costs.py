"""Measures the overlap terms of the ``cpu-gloo`` profile on this machine: 2 local gloo ranks.

* ``collective_issue_us``: host time for ``all_gather_into_tensor(..., async_op=True)`` to return (the
  compute thread is busy issuing for that long; the transfer runs on gloo's worker thread).
* ``compute_slowdown_during_comm``: a 256x256 fp32 matmul loop timed alone and while an all-gather of
  ``--mib`` MiB runs on the same process (gloo's worker copies and sends on another thread of the same CPU).

Usage: ``python benchmarks/overlap_costs.py [--mib 16] [--repeats 5]``; prints one JSON object (median of
the repeats and the load average).  The machine's other load makes single runs noisy: use the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _matmul_loop(a, b, until: float) -> tuple[int, float]:
    n, t0 = 0, time.perf_counter()
    while True:
        a @ b
        n += 1
        t = time.perf_counter()
        if t >= until:
            return n, (t - t0) / n


def measure_overlap(mib: int, repeats: int) -> dict:
    """Medians of ``repeats`` measurements on the initialised default group (every rank calls it)."""
    import torch
    import torch.distributed as dist

    shard = torch.randn(mib * 2**20 // 4 // dist.get_world_size())
    gathered = torch.empty(shard.numel() * dist.get_world_size())
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    issue_us, slowdown = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(gathered, shard)
        comm_s = time.perf_counter() - t0
        dist.barrier()
        _, alone = _matmul_loop(a, b, time.perf_counter() + comm_s)
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_gather_into_tensor(gathered, shard, async_op=True)
        issue_us.append((time.perf_counter() - t0) * 1e6)
        # time matmuls only while the collective is certainly in flight (its first 60 %)
        _, during = _matmul_loop(a, b, t0 + 0.6 * comm_s)
        work.wait()
        slowdown.append(during / alone - 1.0)
    return {"collective_issue_us": statistics.median(issue_us),
            "compute_slowdown_during_comm": max(0.0, statistics.median(slowdown)),
            "issue_us_all": issue_us, "slowdown_all": slowdown, "mib": mib, "loadavg": os.getloadavg()}


def _rank(rank: int, init: str, mib: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    result = measure_overlap(mib, repeats)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.spawn(_rank, args=(init, args.mib, args.repeats, out), nprocs=2)
        with open(out) as fh:
            print(json.dumps(json.load(fh), indent=1))


if __name__ == "__main__":
    main()
