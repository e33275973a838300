"""Stress for heap corruption: runs a two-rank benchmark again and again and counts the runs a rank died in.

Each run is the fidelity benchmark's smoke run (two gloo ranks over the emulated link: link probe, collective
sweep, profiled steps, then every configuration, reordering ones included, compiled and stepped) unless
``--command`` names another.  A run fails when it exits non-zero; a *heap abort* is a failure whose output
carries one of glibc's heap-check messages.  Ranks run with core dumps on (``ulimit -c unlimited``, in the
run's own folder) and faulthandler on, so an abort leaves its Python stacks in the log and a core to read
with ``gdb python core``; a run that passed is deleted, a failed one is kept.

    sudo python benchmarks/heap_stress.py --runs 50 --out benchmarks/results/heap_stress.json
    sudo python benchmarks/heap_stress.py --runs 20 --malloc-check      # glibc's checking malloc as well

``--malloc-check`` preloads glibc's ``libc_malloc_debug.so`` with ``MALLOC_CHECK_=3`` and
``MALLOC_PERTURB_``: frees are checked and freed memory is filled, so a late write shows sooner.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAP_ABORT = re.compile(r"(malloc|free|realloc)\(\): [^\n]*|double free or corruption[^\n]*|corrupted size vs[^\n]*")
MALLOC_DEBUG = ("/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0", "/lib64/libc_malloc_debug.so.0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--command", default=None,
                   help="shell command of one run (default: the fidelity smoke run); {out} is the run's folder")
    p.add_argument("--malloc-check", action="store_true", help="glibc's checking malloc in every rank")
    p.add_argument("--keep", default="/tmp/fsdp_passes_heap_stress", help="folder for failed runs' logs and cores")
    p.add_argument("--out", default=None, help="JSON summary (default: print only)")
    return p.parse_args(argv)


def _env(malloc_check: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    if malloc_check:
        lib = next((p for p in MALLOC_DEBUG if os.path.exists(p)), None)
        if lib is None:
            raise SystemExit("heap_stress: --malloc-check needs glibc's libc_malloc_debug.so.0")
        env.update(LD_PRELOAD=lib, MALLOC_CHECK_="3", MALLOC_PERTURB_="165")
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keep = Path(args.keep)
    keep.mkdir(parents=True, exist_ok=True)
    command = args.command or (f"{sys.executable} {REPO / 'benchmarks' / 'fidelity.py'} --smoke "
                               f"--out {{out}}/fidelity.json --prefix fsdpheap")
    env = _env(args.malloc_check)
    runs = []
    for i in range(args.runs):
        folder = keep / f"run{i:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        proc = subprocess.run(["bash", "-c", f"ulimit -c unlimited; {command.format(out=folder)}"], cwd=folder,
                              env=env, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        abort = HEAP_ABORT.search(output) if proc.returncode != 0 else None
        run = {"run": i, "rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
               "load_1min": os.getloadavg()[0], "heap_abort": abort[0] if abort else None,
               # the launcher prints only the ranks' last lines, which can miss glibc's message: a core says a rank crashed
               "cores": sorted(p.name for p in folder.glob("core*"))}
        runs.append(run)
        print(json.dumps(run), flush=True)
        if proc.returncode == 0:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            (folder / "output.log").write_text(output)
    summary = {"command": command, "malloc_check": args.malloc_check, "runs": len(runs),
               "failed": sum(r["rc"] != 0 for r in runs), "heap_aborts": sum(bool(r["heap_abort"]) for r in runs),
               "seconds_per_run": [r["seconds"] for r in runs], "load_1min": [r["load_1min"] for r in runs],
               "failures": [r for r in runs if r["rc"] != 0]}
    print(f"heap_stress: {summary['runs']} runs, {summary['failed']} failed, {summary['heap_aborts']} heap aborts")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
