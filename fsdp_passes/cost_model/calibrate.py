"""Measure collective times on the running process group and build a calibration table.

Every rank measures; the per-size medians are reduced with MAX so all ranks hold the same table (the slowest
rank is what a collective waits for).  The command line and the process launcher are ``fsdp_passes.cli.calibrate``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Sequence

from ..dag.collectives import KINDS
from ..dag.graph import CollectiveOp
from .calibration import Calibration

__all__ = ["DEFAULT_OPS", "DEFAULT_SIZES", "calibrate", "float_dtype"]

#: the kinds calibration can time (those with an eager call)
DEFAULT_OPS = tuple(op for op, kind in KINDS.items() if kind.eager)
# 64 KiB .. 256 MiB, every 4x: covers per-layer FSDP payloads
DEFAULT_SIZES = tuple(1 << k for k in range(16, 29, 2))


def float_dtype(name: str) -> Any:
    """The floating torch dtype called ``name``; ValueError otherwise."""
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
    progress: Optional[Callable[[str], None]] = None,
    samples: Optional[list] = None,
) -> Calibration:
    """Time each op at each size on ``group`` (default: the world) and return the agreed table.

    Each sample is barrier-synchronised and timed on the host around the collective (plus a device
    synchronise on GPUs); the per-size value is the median of ``iters`` samples after ``warmup`` runs,
    then MAX-reduced over ranks.  Sizes are full payloads (gathered / pre-scatter / buffer), rounded down
    to a whole number of elements per rank.  Collective only: every rank of ``group`` must call it.
    ``progress``, when given, is called with one line per point measured (this rank's median, before the
    ranks agree on the slowest), so that a sweep of minutes is not silent.  ``samples``, when given a list,
    receives one ``(op, nbytes, [ms, ...])`` per point: every timed sample of the rank whose median the table
    holds (the slowest; the same on every rank), for the spread of a point.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("calibrate() needs an initialised default process group")
    if iters < 1:
        raise ValueError(f"iters={iters!r} is not valid: expected an integer >= 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup!r} is not valid: expected an integer >= 0")
    dt = float_dtype(dtype)
    n = dist.get_world_size(group)
    backend = dist.get_backend(group)
    use_cuda = backend == "nccl" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    itemsize = torch.empty((), dtype=dt).element_size()

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(device)

    measured: list[tuple[CollectiveOp, int, float]] = []
    all_times: list[list[float]] = []
    for op in ops:
        for size in sizes:
            per_rank = max(1, size // (itemsize * n))
            full = per_rank * n
            fn = _timed_call(KINDS[op], full, n, group, dtype=dt, device=device)
            for _ in range(warmup):
                fn()
            sync()
            times = []
            for _ in range(iters):
                dist.barrier(group=group)
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            measured.append((op, full * itemsize, statistics.median(times)))
            all_times.append(times)
            if progress is not None:
                progress(f"{op.value} {full * itemsize} B: {measured[-1][2]:.4g} ms "
                         f"({len(measured)}/{len(ops) * len(sizes)})")
    # every rank must write the same table: take the slowest rank's median for each point
    agreed = torch.tensor([ms for _, _, ms in measured], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    if samples is not None:
        mine = torch.tensor(all_times, dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(every, mine, group=group)
        for i, (op, nbytes, _) in enumerate(measured):
            slowest = max((e[i].tolist() for e in every), key=statistics.median)
            samples.append((op.value, nbytes, slowest))
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


def _timed_call(kind: Any, full: int, n: int, group: Any, **like: Any) -> Callable[[], Any]:
    """One call of ``kind``'s eager collective on a payload of ``full`` elements over ``n`` ranks: its input
    filled with ones, its output (where not as large as the input: then it works in place) empty; ``like``:
    the tensors' dtype and device."""
    import torch
    import torch.distributed as dist

    # the *_single names replace the *_tensor ones (deprecated) in recent torch releases: the first present
    call = next((getattr(dist, name) for name in kind.eager if hasattr(dist, name)), None)
    if call is None:
        allowed = ", ".join(op.value for op in DEFAULT_OPS)
        raise ValueError(f"ops: {kind.op!r} cannot be calibrated, expected {allowed}")
    inp = torch.ones(kind.input_numel(full, n), **like)
    if not (kind.gathers or kind.scatters):
        return lambda: call(inp, group=group)
    out = torch.empty(kind.output_numel(inp.numel(), n), **like)
    return lambda: call(out, inp, group=group)
