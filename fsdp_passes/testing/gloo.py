"""Run a function on a real multi-process gloo group on this machine."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["run_on_gloo", "RankFailed", "set_gloo_worker_threads"]


class RankFailed(RuntimeError):
    """A rank of :func:`run_on_gloo` raised; the message carries its traceback."""

    def __init__(self, rank: int, tb: str) -> None:
        super().__init__(f"rank {rank} failed:\n{tb}")
        self.rank = rank
        self.traceback = tb


def set_gloo_worker_threads(threads: int | None) -> None:
    """Make every gloo group created after this call (``init_process_group("gloo")``, ``new_group``) run its
    collectives on ``threads`` worker threads; ``None`` restores torch's own (2 per device).

    torch gives ``init_process_group`` no option for it, so this replaces the ``ProcessGroupGloo`` that
    ``torch.distributed.distributed_c10d`` constructs with a subclass that passes the thread count in its
    options (devices as torch picks them: the ``GLOO_SOCKET_IFNAME`` interfaces, else the default device).
    With one thread a rank's collectives run one after another in issue order, still asynchronously to the
    main thread; with two, two collectives on the same gloo context run at once: the setting in which
    ``benchmarks/gloo_view_race.py``'s runs corrupted the heap (none did with one thread)."""
    import torch.distributed.distributed_c10d as c10d

    base = getattr(c10d.ProcessGroupGloo, "_fsdp_passes_base", c10d.ProcessGroupGloo)
    if threads is None:
        c10d.ProcessGroupGloo = base
        return
    if threads < 1:
        raise ValueError(f"set_gloo_worker_threads: threads={threads}; expected >= 1")

    class GlooWithThreads(base):  # type: ignore[misc, valid-type]
        _fsdp_passes_base = base

        def __init__(self, store: Any, rank: int, size: int, timeout: timedelta = timedelta(minutes=30)) -> None:
            opts = base._Options()
            ifnames = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
            opts._devices = ([base.create_device(interface=i) for i in ifnames] if ifnames
                             else [base.create_default_device()])
            opts._timeout = timeout
            opts._threads = threads
            super().__init__(store, rank, size, opts)

    c10d.ProcessGroupGloo = GlooWithThreads


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, timeout: float, fn: Callable[..., Any], args: tuple,
               results: Any, fault_path: str) -> None:
    # a crash (abort, segfault) leaves no Python traceback in the result queue: the interpreter writes the
    # threads' stacks here instead, for the parent's failure report (the file stays open until the process ends)
    faulthandler.enable(file=open(fault_path, "w"), all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from ..inductor.install import set_compile_threads

    set_compile_threads(1)
    # one gloo worker thread: with torch's two, collectives in flight together corrupt the heap now and then
    # (benchmarks/gloo_view_race.py, without fsdp_passes); with one they run in issue order, as NCCL runs a
    # group's collectives on its one stream
    set_gloo_worker_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return "is still running" if code is None else f"exited with code {code}"


def _fault_path(fault_dir: str, rank: int) -> str:
    """Where rank ``rank`` writes its stacks if it crashes."""
    return os.path.join(fault_dir, f"rank{rank}.txt")


def _crash_text(procs: list, rank: int, fault_dir: str, max_lines: int = 40) -> str:
    """How rank ``rank``'s process ended, with the stacks the interpreter wrote when it crashed."""
    text = f"{_exit_text(procs[rank].exitcode)} without a result"
    try:
        with open(_fault_path(fault_dir, rank)) as f:
            stacks = f.read().strip().splitlines()[-max_lines:]
    except OSError:
        stacks = []
    if stacks:
        text += f" (its stacks, last {len(stacks)} lines:\n  " + "\n  ".join(stacks) + ")"
    return text


def _other_ranks(procs: list, failed: int, out: dict[int, Any], results: Any, fault_dir: str,
                 wait_s: float = 5.0) -> str:
    """What the other ranks did, read within ``wait_s`` of one rank's failure: a rank's error often follows
    from another's (a peer that crashed resets the connection), and a crash leaves no traceback of its own."""
    errors: dict[int, str] = {}
    finished: set[int] = set()
    deadline = time.monotonic() + wait_s
    pending = [r for r in range(len(procs)) if r != failed and r not in out]
    while pending and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
            if ok:
                finished.add(rank)
            else:
                errors[rank] = value.strip().splitlines()[-1] if value.strip() else "an error"
            pending = [r for r in pending if r != rank]
        except queue.Empty:
            pending = [r for r in pending if procs[r].is_alive()]
    lines = []
    for r in range(len(procs)):
        if r == failed or r in out or r in finished:
            continue
        if r in errors:
            lines.append(f"rank {r} raised: {errors[r]}")
        else:
            lines.append(f"rank {r} {_crash_text(procs, r, fault_dir)}")
    return "\nother ranks: " + "; ".join(lines) if lines else ""


def run_on_gloo(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined by a gloo group.

    The group (127.0.0.1, a free port) is the default process group in each process and is destroyed when
    ``fn`` returns; each process uses one intra-op thread.  ``fn``, ``args`` and the results must be
    picklable (``fn`` defined at module level; a script calling this needs the usual
    ``if __name__ == "__main__":`` guard, as processes are spawned).  Returns the results in rank order.  Raises
    :class:`RankFailed` (with the rank's traceback, and what the other ranks did: their errors, or how a crashed
    one ended) if a rank raises or dies, ``TimeoutError`` after ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"run_on_gloo: world_size={world_size}, expected >= 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    fault_dir = tempfile.mkdtemp(prefix="run_on_gloo_")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, timeout, fn, args, results,
                                             _fault_path(fault_dir, r)),
                    name=f"gloo-rank-{r}")
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"run_on_gloo: ranks {missing} did not finish within {timeout} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and not p.is_alive() and p.exitcode != 0]
                if dead:
                    raise RankFailed(dead[0], f"process {_crash_text(procs, dead[0], fault_dir)}"
                                     + _other_ranks(procs, dead[0], out, results, fault_dir))
                continue
            if not ok:
                raise RankFailed(rank, value + _other_ranks(procs, rank, out, results, fault_dir))
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        results.close()
        shutil.rmtree(fault_dir, ignore_errors=True)
    return [out[r] for r in range(world_size)]
