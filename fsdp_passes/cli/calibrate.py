"""``python -m fsdp_passes calibrate``: measure collective times and write a calibration table.

Either runs inside an existing job (launched by torchrun: the default process group is used, NCCL on GPUs)
or, when nothing launched it, spawns ``--world-size`` local gloo processes itself; rank 0 writes the table
that ``fsdp_passes.cost_model.calibrate.calibrate`` measured.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from ..cost_model.calibrate import DEFAULT_OPS, DEFAULT_SIZES, calibrate, float_dtype
from ..dag.graph import CollectiveOp
from .common import say

__all__ = ["add_arguments", "parse_size", "run"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


class SizeError(argparse.ArgumentTypeError, ValueError):
    """A ``--sizes`` entry that is not a size: argparse prints its message (it replaces a plain ValueError's)."""


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
        raise SizeError(f"--sizes entry {text!r} is not valid: expected a positive size like 65536, 64K or 1MiB")
    return int(value * _UNITS[unit])


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

    rank0 = dist.get_rank() == 0
    sizes = args.sizes or DEFAULT_SIZES
    if rank0:
        say(f"calibrate: {len(args.ops)} collective(s) x {len(sizes)} size(s) on {dist.get_world_size()} "
            f"{dist.get_backend()} rank(s), {args.warmup} + {args.iters} iterations each (rank 0's medians below; "
            f"the table keeps the slowest rank's)")
    cal = calibrate(
        sizes=sizes,
        iters=args.iters,
        warmup=args.warmup,
        ops=[CollectiveOp(o) for o in args.ops],
        dtype=args.dtype,
        progress=(lambda line: say(f"calibrate: {line}")) if rank0 else None,
    )
    if rank0:
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
    float_dtype(args.dtype)


def run(args: argparse.Namespace) -> int:
    """Entry point of the CLI subcommand; returns the process exit code."""
    import torch
    import torch.distributed as dist

    # a bad value raises ValueError before anything is spawned: the command line reports it as one line
    if args.trace:
        from ..cost_model import calibrate_from_trace

        calibrate_from_trace(args.trace).save(args.out)
        say(f"calibrate: wrote {args.out} from {args.trace}")
        return 0
    _validate_args(args)
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

        # only the measurement settings travel to the ranks: a parsed command line also holds its handler,
        # which may live in a __main__ module the spawned processes cannot import
        settings = argparse.Namespace(**{k: getattr(args, k) for k in ("out", "sizes", "iters", "warmup", "ops", "dtype")})
        mp.spawn(_spawned_rank, args=(args.world_size, _free_port(), settings), nprocs=args.world_size, join=True)
    say(f"calibrate: wrote {args.out}")
    return 0
