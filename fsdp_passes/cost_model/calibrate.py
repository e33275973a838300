"""Measure collective times on the running cluster and write a calibration table.

``python -m fsdp_passes calibrate --out FILE`` either runs inside an existing job (launched by torchrun:
the default process group is used, NCCL on GPUs) or, when nothing launched it, spawns ``--world-size``
local gloo processes itself.  Every rank measures; the per-size medians are reduced with MAX so all ranks
hold the same table (the slowest rank is what a collective waits for), and rank 0 writes it.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Sequence

from ..dag.graph import CollectiveOp
from .calibration import Calibration

__all__ = ["DEFAULT_SIZES", "add_arguments", "calibrate", "parse_size", "run"]

DEFAULT_OPS = (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE)
# 64 KiB .. 256 MiB, every 4x: covers per-layer FSDP payloads
DEFAULT_SIZES = tuple(1 << k for k in range(16, 29, 2))

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``"65536"``, ``"64K"``, ``"64KiB"``, ``"1M"`` -> bytes (binary units: sizes are buffer sizes)."""
    s = str(text).strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ValueError(f"--sizes entry {text!r} is not valid: expected a positive size like 65536, 64K or 1MiB")
    return int(value * _UNITS[unit])


def _dtype(name: str):
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"--dtype {name!r} is not valid: expected a floating dtype such as float32 or bfloat16")
    return dt


def calibrate(
    sizes: Sequence[int] = DEFAULT_SIZES,
    iters: int = 20,
    warmup: int = 3,
    ops: Sequence[CollectiveOp] = DEFAULT_OPS,
    dtype: str = "float32",
    group=None,
) -> Calibration:
    """Time each op at each size on ``group`` (default: the world) and return the agreed table.

    Each sample is barrier-synchronised and timed on the host around the collective (plus a device
    synchronise on GPUs); the per-size value is the median of ``iters`` samples after ``warmup`` runs,
    then MAX-reduced over ranks.  Sizes are full payloads (gathered / pre-scatter / buffer), rounded down
    to a whole number of elements per rank.  Collective only: every rank of ``group`` must call it.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("calibrate() needs an initialised default process group")
    if iters < 1:
        raise ValueError(f"iters={iters!r} is not valid: expected an integer >= 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup!r} is not valid: expected an integer >= 0")
    dt = _dtype(dtype)
    n = dist.get_world_size(group)
    backend = dist.get_backend(group)
    use_cuda = backend == "nccl" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    itemsize = torch.empty((), dtype=dt).element_size()

    # the *_single names replace the *_tensor ones (deprecated) in recent torch releases
    _all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(device)

    measured: list[tuple[CollectiveOp, int, float]] = []
    for op in ops:
        for size in sizes:
            per_rank = max(1, size // (itemsize * n))
            full = per_rank * n
            if op is CollectiveOp.ALL_GATHER:
                inp = torch.ones(per_rank, dtype=dt, device=device)
                out = torch.empty(full, dtype=dt, device=device)
                fn = lambda: _all_gather(out, inp, group=group)  # noqa: E731
            elif op is CollectiveOp.REDUCE_SCATTER:
                inp = torch.ones(full, dtype=dt, device=device)
                out = torch.empty(per_rank, dtype=dt, device=device)
                fn = lambda: _reduce_scatter(out, inp, group=group)  # noqa: E731
            elif op is CollectiveOp.ALL_REDUCE:
                buf = torch.ones(full, dtype=dt, device=device)
                fn = lambda: dist.all_reduce(buf, group=group)  # noqa: E731
            else:
                raise ValueError(f"ops: {op!r} cannot be calibrated, expected all_gather, reduce_scatter or all_reduce")
            for _ in range(warmup):
                fn()
            sync()
            samples = []
            for _ in range(iters):
                dist.barrier(group=group)
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                samples.append((time.perf_counter() - t0) * 1e3)
            measured.append((op, full * itemsize, statistics.median(samples)))
    # every rank must write the same table: take the slowest rank's median for each point
    agreed = torch.tensor([ms for _, _, ms in measured], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    cal = Calibration(
        meta={
            "backend": str(backend),
            "world_size": n,
            "dtype": str(dt).replace("torch.", ""),
            "iters": iters,
            "warmup": warmup,
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
            "torch": torch.__version__,
        }
    )
    for (op, nbytes, _), ms in zip(measured, agreed.tolist()):
        cal.add_collective(op, n, nbytes, max(ms, 1e-6))
    return cal


# -- command line ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m fsdp_passes calibrate``."""
    parser.add_argument("--out", required=True, help="calibration JSON file to write")
    parser.add_argument("--trace", default=None, help="calibrate from this torch.profiler Chrome trace of a real "
                        "step instead of sweeping collectives (see fsdp_passes.calibrate_from_trace)")
    parser.add_argument(
        "--sizes", nargs="+", type=parse_size, default=None,
        help="payload sizes in bytes (full gathered / pre-scatter size; K/M/G suffixes are binary), "
             "default 64K..256M every 4x",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per size (median is kept)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per size")
    parser.add_argument(
        "--ops", nargs="+", default=[o.value for o in DEFAULT_OPS],
        choices=[o.value for o in DEFAULT_OPS], help="collectives to measure",
    )
    parser.add_argument("--dtype", default="float32", help="element dtype of the buffers")
    parser.add_argument(
        "--world-size", type=int, default=2,
        help="processes to spawn (local gloo) when not launched by torchrun; ignored under torchrun",
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure_and_write(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    cal = calibrate(
        sizes=args.sizes or DEFAULT_SIZES,
        iters=args.iters,
        warmup=args.warmup,
        ops=[CollectiveOp(o) for o in args.ops],
        dtype=args.dtype,
    )
    if dist.get_rank() == 0:
        cal.save(args.out)
    dist.barrier()


def _spawned_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _measure_and_write(args)
    finally:
        dist.destroy_process_group()


def _validate_args(args: argparse.Namespace) -> None:
    if args.iters < 1:
        raise ValueError(f"--iters {args.iters} is not valid: expected an integer >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup} is not valid: expected an integer >= 0")
    if args.world_size < 2:
        raise ValueError(f"--world-size {args.world_size} is not valid: expected an integer >= 2")
    _dtype(args.dtype)


def run(args: argparse.Namespace) -> int:
    """Entry point of the CLI subcommand; returns the process exit code."""
    import torch
    import torch.distributed as dist

    try:
        if getattr(args, "trace", None):
            from .trace_calibration import calibrate_from_trace

            calibrate_from_trace(args.trace).save(args.out)
            print(f"calibrate: wrote {args.out} from {args.trace}")
            return 0
        _validate_args(args)
    except ValueError as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 2
    if dist.is_available() and dist.is_initialized():
        _measure_and_write(args)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        try:
            _measure_and_write(args)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        import torch.multiprocessing as mp

        mp.spawn(_spawned_rank, args=(args.world_size, _free_port(), args), nprocs=args.world_size, join=True)
    print(f"calibrate: wrote {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry (``python -m fsdp_passes.cost_model.calibrate``)."""
    parser = argparse.ArgumentParser(prog="fsdp_passes calibrate", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
