"""Minimal reproducer of a heap corruption in gloo collectives, without fsdp_passes' passes.

Two gloo ranks over loopback (a FileStore in a temporary folder).  Every step each rank issues several
functional all-gathers (``_c10d_functional.all_gather_into_tensor``) of parameter-like leaves, does
allocation-heavy work on the main thread while they are in flight (small tensor ops, views of the same leaves,
an autograd forward + backward over the same leaves), then waits (``wait_tensor``) and checks the gathered
values.  The gloo worker threads meanwhile run ``AsyncAllgatherCoalescedWork::run``, whose
``flattenDenseTensors`` makes a view of each input under the issuing thread's captured TLS (grad mode
included), the path the aborting rank's core showed.

Variants (``--variant``) change what reaches the collective and how it is issued:

    leaf            the requires-grad leaf itself, issued with grad mode on (eager).  Fails every time, at once:
                    the Work runs under the issuer's captured TLS (grad mode on) and its copy into the output's
                    chunks raises "A view was created in no_grad mode and is being modified inplace with grad
                    mode enabled ..." at wait_tensor.  fsdp_passes never issues like this (GatherShard.forward and
                    compiled graphs run with grad mode off), so this variant is not a stress variant.
    leaf_nograd     the leaf, issued under ``torch.no_grad()`` (the worker's captured TLS has grad mode off)
    detach          ``leaf.detach()`` issued with grad mode on (an alias with no autograd history)
    plain           leaves that do not require grad at all
    leaf_nobw       as ``leaf`` but no backward on the main thread between issue and wait
    compiled        ``torch.compile``'d function (no fsdp_passes) whose graph gathers its primals (the
                    leaves), computes, then waits; forward + backward each step
    compiled_detach as ``compiled`` but the leaves are detached in eager before the call

``--threads`` sets gloo's worker threads (default 2, as ``init_process_group`` uses); ``--inflight`` the
gathers in flight per step.  The launcher (default mode) runs ``--runs`` runs of each variant, optionally
under glibc's checking malloc (``--malloc check``: ``LD_PRELOAD=libc_malloc_debug.so.0 MALLOC_CHECK_=3
MALLOC_PERTURB_=165``), counts failed runs and heap aborts and writes a JSON summary.

    python benchmarks/gloo_view_race.py --variants plain,leaf_nograd --runs 3 --steps 4000 --cores --out x.json

What it showed (benchmarks/results/gloo_view_race.json has the counts; torch 2.13.0+cpu, loopback, 2 shared
cores): with gloo's default 2 worker threads and 4 gathers in flight, 9 of 34 eager runs died within 4000
steps: ``malloc(): unaligned tcache chunk detected`` (the fidelity runs' abort, on a gloo worker thread),
``free(): invalid pointer`` (checking malloc, in ``ProcessGroupGloo::runLoop``), SIGSEGV in
``gloo::transport::tcp::UnboundBuffer::~UnboundBuffer`` at the end of ``allgather_coalesced``, or a hang with
a worker spinning in that destructor.  ``plain`` inputs (no requires_grad) failed as often as requires-grad
leaves, so torch's autograd views of the inputs are not needed.  With one gloo worker thread
(``--threads 1``, 8 runs) or one gather in flight (``--inflight 1``, 9 runs) no run failed.  Gathering only
large buffers (``--min-numel 4096``) failed too (1 of 9).  The compiled variants ran too few steps to say
anything (0 of 4).  Which write corrupts the heap was not identified.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAP_ABORT = re.compile(r"(malloc|free|realloc)\(\): [^\n]*|double free or corruption[^\n]*|corrupted size vs[^\n]*"
                        r"|malloc_consolidate[^\n]*|corrupted double-linked list[^\n]*")
MALLOC_DEBUG = ("/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0", "/lib64/libc_malloc_debug.so.0")
VARIANTS = ("leaf", "leaf_nograd", "detach", "plain", "leaf_nobw", "compiled", "compiled_detach")
WORLD = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="leaf,detach", help=f"comma-separated, of {VARIANTS}")
    p.add_argument("--runs", type=int, default=2, help="runs per variant (and per malloc mode)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--inflight", type=int, default=4, help="all-gathers issued before the first wait")
    p.add_argument("--threads", type=int, default=2, help="gloo worker threads")
    p.add_argument("--min-numel", type=int, default=0,
                   help="only the parameter shapes with at least this many elements (4096: no gathered buffer "
                        "small enough for glibc's tcache)")
    p.add_argument("--inductor-reorder", action="store_true",
                   help="compiled variants: Inductor's reorder_for_compute_comm_overlap (sink_waits, raise_comms)")
    p.add_argument("--malloc", default="plain", help="comma-separated of plain,check")
    p.add_argument("--cores", action="store_true",
                   help="ranks dump core (loopback runs); a failed run keeps gdb's stacks of each core")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="run the first N steps under torch.profiler (fidelity.py profiles before its configurations)")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="run the ranks in two network namespaces over a tc-tbf-capped veth pair of this rate "
                        "(emulated_cluster.Cluster; needs root), e.g. 400mbit; default: loopback")
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--stall", type=float, default=90.0,
                   help="seconds without output from any rank (both alive) that count as a hang")
    p.add_argument("--progress-every", type=int, default=250, help="a rank prints a line every N steps")
    p.add_argument("--keep", default="/tmp/gloo_view_race", help="folder for failed runs' logs")
    p.add_argument("--out", default=None)
    # worker mode
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", default="leaf", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- rank side

SHAPES = [(64,), (256, 32), (4096,), (512, 64), (33,), (1024, 96), (8,), (2048, 32)]


_KEEP: list = []


def _group(threads: int):
    """The default group, or (``threads`` != 2) a gloo group with that many worker threads, registered for
    functional collectives under its own name."""
    import torch.distributed as dist
    pg = dist.group.WORLD
    if threads == 2:
        return pg.group_name
    from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo, _register_process_group
    store = dist.PrefixStore("threads_group/", dist.distributed_c10d._get_default_store())
    opts = ProcessGroupGloo._Options()
    opts._threads = threads
    opts._devices = [ProcessGroupGloo.create_default_device()]
    backend = ProcessGroupGloo(store, dist.get_rank(), WORLD, opts)
    group = ProcessGroup(store, dist.get_rank(), WORLD)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    group._register_backend(__import__("torch").device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    name = f"gloo_threads{threads}"
    group._set_group_name(name)
    _register_process_group(name, group)
    _KEEP.append(group)  # the registry holds it weakly
    return name


def rank_main(args: argparse.Namespace) -> int:
    faulthandler.enable()
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if os.environ.get("MASTER_ADDR"):  # --link: the ranks sit in two namespaces, rank 0 serves the store
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), WORLD,
                              is_master=args.rank == 0, timeout=datetime.timedelta(seconds=120))
    else:
        store = dist.FileStore(args.store, WORLD)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=WORLD)
    gname = _group(args.threads)
    fc = torch.ops._c10d_functional
    v = args.variant
    requires_grad = v != "plain"
    gens = [torch.Generator().manual_seed(1000 * r + 7) for r in range(WORLD)]
    shapes = [s for s in SHAPES if math.prod(s) >= args.min_numel]
    per_rank = [[torch.randn(*s, generator=gens[r]) for s in shapes] for r in range(WORLD)]
    leaves = [t.clone().requires_grad_(requires_grad) for t in per_rank[args.rank]]
    expected = [torch.cat([per_rank[r][i] for r in range(WORLD)]) for i in range(len(shapes))]
    k = min(args.inflight, len(leaves))

    compiled = None
    if v.startswith("compiled"):
        def body(*ps):
            outs = [fc.all_gather_into_tensor(p, WORLD, gname) for p in ps[:k]]
            acc = sum(((p.sin() * 1.5 + p.view(-1)[:1]) ** 2).sum() for p in ps)
            got = [fc.wait_tensor(o) for o in outs]
            return acc, got
        if args.inductor_reorder:  # Inductor's own comm reordering (not fsdp_passes): gathers raised, waits sunk
            import torch._inductor.config as icfg
            icfg.reorder_for_compute_comm_overlap = True
            icfg.reorder_for_compute_comm_overlap_passes = ["sink_waits", "raise_comms"]
        compiled = torch.compile(body, fullgraph=True)

    bad = 0
    t0 = time.monotonic()
    prof = None
    if args.profile_steps:  # as fidelity.py does before its configurations: a few steps under torch.profiler
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        prof.__enter__()
    for step in range(args.steps):
        if prof is not None and step == args.profile_steps:
            prof.__exit__(None, None, None)
            prof = None
        if compiled is not None:
            ins = [p.detach() for p in leaves] if v == "compiled_detach" else leaves
            acc, got = compiled(*ins)
            # main-thread autograd over the same leaves after the compiled forward
            extra = sum((p * p).sum() for p in leaves)
            (acc + extra).backward()
        else:
            if v == "leaf_nograd":
                with torch.no_grad():
                    outs = [fc.all_gather_into_tensor(p, WORLD, gname) for p in leaves[:k]]
            elif v == "detach":
                outs = [fc.all_gather_into_tensor(p.detach(), WORLD, gname) for p in leaves[:k]]
            else:
                outs = [fc.all_gather_into_tensor(p, WORLD, gname) for p in leaves[:k]]
            # allocation-heavy main-thread work while the gathers are in flight
            small = []
            for j in range(40):
                p = leaves[j % len(leaves)]
                small.append((p.view(-1)[: 1 + j % 7] * 0.5 + j).sum())
                small.append(p.detach().reshape(-1)[j % 3:].clone().add_(1.0).mean())
            if v != "leaf_nobw" and requires_grad:
                loss = sum(((p.sin() * 2.0 + p.view(-1)[:1]) ** 2).sum() for p in leaves) + torch.stack(small).sum()
                loss.backward()
            with torch.no_grad():  # wait_tensor in grad mode rejects an output issued from a grad-mode leaf
                got = [fc.wait_tensor(o) for o in outs]
        for i, g in enumerate(got):
            if not torch.equal(g, expected[i]):
                bad += 1
        for p in leaves:
            p.grad = None
        if step % args.progress_every == 0:
            print(f"step {step} {time.monotonic() - t0:.1f}s", flush=True)
    dist.barrier()
    print(f"rank {args.rank} done: {args.steps} steps, {bad} wrong gathers, {time.monotonic() - t0:.1f}s", flush=True)
    dist.destroy_process_group()
    return 2 if bad else 0


# --------------------------------------------------------------------------------------------- launcher

def _env(malloc: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1")
    env.pop("LD_PRELOAD", None)
    if malloc == "check":
        lib = next((p for p in MALLOC_DEBUG if os.path.exists(p)), None)
        if lib is None:
            raise SystemExit("gloo_view_race: malloc=check needs glibc's libc_malloc_debug.so.0")
        env.update(LD_PRELOAD=lib, MALLOC_CHECK_="3", MALLOC_PERTURB_="165")
    return env


def one_run(args: argparse.Namespace, variant: str, malloc: str, keep: Path, index: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gloo_view_race_") as tmp:
        store = os.path.join(tmp, "store")
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(WORLD)]
        cmd = [sys.executable, __file__, "--variant", variant, "--store", store, "--steps", str(args.steps),
               "--inflight", str(args.inflight), "--threads", str(args.threads), "--min-numel", str(args.min_numel)]
        cmd += ["--inductor-reorder"] if args.inductor_reorder else []
        cmd += ["--profile-steps", str(args.profile_steps), "--progress-every", str(args.progress_every)]
        t0 = time.monotonic()
        cluster = None
        if args.link:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from emulated_cluster import Cluster
            cluster = Cluster("gvrace", args.link, script=Path(__file__))
            cluster.open()
            procs = []
            for r in range(WORLD):
                log = Path(tmp) / f"rank{r}.log"
                procs.append(cluster.spawn(r, cmd[2:] + ["--rank", str(r)], _env(malloc), log))
        else:
            procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=logs[r], stderr=subprocess.STDOUT,
                                      env=_env(malloc), cwd=tmp, preexec_fn=_cores_on if args.cores else None)
                     for r in range(WORLD)]
        # watch for a stall: every rank prints a line every --progress-every steps; no new output from any rank
        # for --stall seconds while both live is a hang: record every rank's thread stacks (gdb), then end them
        hang_stacks = None
        sizes, last_change = [0] * WORLD, time.monotonic()
        while any(pr.poll() is None for pr in procs) and time.monotonic() - t0 < args.run_timeout:
            time.sleep(2.0)
            now = [os.path.getsize(os.path.join(tmp, f"rank{r}.log")) for r in range(WORLD)]
            if now != sizes:
                sizes, last_change = now, time.monotonic()
            elif (all(pr.poll() is None for pr in procs) and time.monotonic() - last_change > args.stall
                  and hang_stacks is None):
                hang_stacks = _stacks(procs)
                break
        rcs = []
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                rcs.append(f"killed({'hang' if hang_stacks is not None else 'timeout'})")
                pr.wait()
            else:
                rcs.append(pr.returncode)
        # a rank that died leaves its peer blocked in a collective: end the peer (only our own children)
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
        if cluster is not None:
            cluster.close()
        core_stacks = _core_stacks(Path(tmp)) if args.cores else ""
        outputs = []
        for f in logs:
            f.seek(0)
            outputs.append(f.read())
            f.close()
    output = "\n".join(outputs)
    abort = HEAP_ABORT.search(output)
    hang = None
    if hang_stacks is not None:  # the gloo frames that show where each rank's threads sat
        hang = sorted({m for m in re.findall(r" in ((?:gloo|c10d)::[A-Za-z_:~]+)", hang_stacks)})
    failed = any(rc != 0 for rc in rcs)
    run = {"variant": variant, "malloc": malloc, "run": index, "rcs": rcs, "seconds": round(time.monotonic() - t0, 1),
           "load_1min": round(os.getloadavg()[0], 2), "heap_abort": abort[0] if abort else None, "hang": hang,
           "wrong_gathers": sum(int(m) for m in re.findall(r"(\d+) wrong gathers", output)),
           "completed_steps": [int(m) for m in re.findall(r"done: (\d+) steps", output)],
           "last_step": max((int(m) for m in re.findall(r"^step (\d+) ", output, re.M)), default=None)}
    if failed or abort:
        folder = keep / f"{os.getpid()}_{variant}_{malloc}_{index:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        for r, text in enumerate(outputs):
            (folder / f"rank{r}.log").write_text(text)
        if hang_stacks is not None:
            (folder / "hang_stacks.txt").write_text(hang_stacks)
        if core_stacks:
            (folder / "core_stacks.txt").write_text(core_stacks)
        run["kept"] = str(folder)
    return run


def _cores_on() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _core_stacks(folder: Path) -> str:
    """Thread stacks of any core file a rank left in ``folder`` (core_pattern ``core``: the rank's cwd)."""
    out = []
    for core in sorted(folder.glob("core*")):
        try:
            res = subprocess.run(["gdb", "-q", "-batch", sys.executable, str(core), "-ex", "thread apply all bt 30"],
                                 capture_output=True, text=True, timeout=300)
            lines = [ln[:250] for ln in res.stdout.splitlines() if ln.startswith(("#", "Thread", "Program"))]
        except (OSError, subprocess.TimeoutExpired) as e:
            lines = [f"gdb failed: {e}"]
        out.append(f"=== {core.name}\n" + "\n".join(lines))
    return "\n".join(out) + ("\n" if out else "")


def _stacks(procs: list) -> str:
    """Every live rank's thread stacks (gdb batch mode; empty if gdb is missing)."""
    out = []
    for r, pr in enumerate(procs):
        try:
            res = subprocess.run(["gdb", "-q", "-batch", "-p", str(pr.pid), "-ex", "thread apply all bt 14"],
                                 capture_output=True, text=True, timeout=120)
            lines = [ln[:250] for ln in res.stdout.splitlines() if ln.startswith(("#", "Thread"))]
        except (OSError, subprocess.TimeoutExpired) as e:
            lines = [f"gdb failed: {e}"]
        out.append(f"=== rank {r} (pid {pr.pid})\n" + "\n".join(lines))
    return "\n".join(out) + "\n"


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; one of {VARIANTS}")
    keep = Path(args.keep)
    runs = []
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for malloc in args.malloc.split(","):
        for v in variants:
            for i in range(args.runs):
                run = one_run(args, v, malloc, keep, i)
                runs.append(run)
                print(json.dumps(run), flush=True)
    table = {}
    for r in runs:
        key = f"{r['variant']}/{r['malloc']}"
        t = table.setdefault(key, {"runs": 0, "steps_per_rank": 0, "failed": 0, "heap_aborts": 0, "hangs": 0,
                                   "wrong_gathers": 0, "steps_before_failure": []})
        t["runs"] += 1
        t["steps_per_rank"] += min(r["completed_steps"]) if len(r["completed_steps"]) == WORLD else 0
        t["failed"] += any(rc != 0 for rc in r["rcs"])
        t["heap_aborts"] += bool(r["heap_abort"])
        t["hangs"] += bool(r["hang"] is not None)
        if r["last_step"] is not None and len(r["completed_steps"]) < WORLD:
            t["steps_before_failure"].append(r["last_step"])
        t["wrong_gathers"] += r["wrong_gathers"]
    summary = {"date": started, "commit": _git_commit(), "torch": __import__("torch").__version__,
               "argv": sys.argv[1:], "steps": args.steps, "inflight": args.inflight, "threads": args.threads, "min_numel": args.min_numel,
               "inductor_reorder": args.inductor_reorder, "link": args.link or "loopback",
               "profile_steps": args.profile_steps,
               "load_avg_end": os.getloadavg(), "by_variant": table, "runs": runs}
    for key, t in table.items():
        print(f"gloo_view_race: {key}: {t}")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if any(t["failed"] for t in table.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
