"""Real compute/communication overlap on an emulated two-node cluster.

Two ranks, each in its own network namespace, joined by a veth pair whose ends are rate-limited with a
token bucket (``tc qdisc ... tbf rate 400mbit burst 256kb latency 200ms``); gloo talks over that link, each
rank computes on one thread.  A SimpleFSDP MLP sized so that a step's communication takes about as long as
its compute is timed under several configurations, alternated step by step.  ``--model llama`` times a
small Llama (embeddings, GQA attention, SwiGLU, tied to nothing; cross-entropy loss) instead of the MLP.

    fsdp2_eager       torch.distributed.fsdp.fully_shard (per layer + root), eager
    compiled          SimpleFSDP model under torch.compile, no communication passes
    inductor_builtin  + Inductor's legacy passes (bucket_*_fx="all", reorder_for_compute_comm_overlap passes)
    inductor_overlap  + Inductor's OverlapScheduler with collective bucketing, as torchtitan's graph_trainer
                      configures it ("auto_bucketing"; _inductor_peers.py; not in the default --configs)
    inductor_manual   + Inductor's manual_overlap_bucketing, a bucket per block, as torchtitan configures it
                      ("transformer_block_bucketing"; not in the default --configs)
    fsdp_passes       + fsdp_passes.enable(bucketing="auto") (the cost-model planner, the default)
    fsdp_passes_separate  the same, the model wrapped with data_parallel(reduce_scatter_group="separate"):
                      gradient reduce-scatters on a second process group over the same ranks
    fsdp_passes_manual + fsdp_passes.enable(bucketing="manual", bucket_plan=["layers.[0-N]"]): a bucket per layer
    compute_only      the same model unsharded under torch.compile: the step without collectives
    comm_only         the step's collectives alone (same sizes and order, all issued asynchronously)

After the timed steps every configuration runs more, untimed steps under ``torch.profiler``: one with
``profile_memory=True`` (the peak of the tensor bytes the step allocates, from the profiler's memory events),
then ``--profiled-steps`` without it, alternated (the time the step blocks in collective waits during
backward: its exposed communication).

``--balanced`` sizes the batch from a probe instead of ``--batch``: both ranks time the unsharded model's
eager step at a probe batch and the step's collectives on the link, and the batch is scaled so that compute
takes ``--compute-over-comm`` times as long as communication (default 1; compute grows with the batch,
communication does not): 2 makes the step compute-bound, 0.5 communication-bound.

    sudo python benchmarks/emulated_cluster.py                 # full run, writes results/emulated_cluster.json
    sudo python benchmarks/emulated_cluster.py --balanced --out /tmp/balanced.json   # batch from the probe
    sudo python benchmarks/emulated_cluster.py --smoke --out /tmp/smoke.json
    sudo python benchmarks/emulated_cluster.py --model llama --balanced --compute-over-comm 2 \
        --configs inductor_builtin,inductor_overlap,inductor_manual,fsdp_passes,fsdp_passes_manual,compute_only,comm_only

Needs root, ``ip`` and ``tc``.  The namespaces (and so the veth pair) are deleted on every exit path.
The script re-executes itself inside each namespace with ``--rank R``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "emulated_cluster.json"
DEFAULT_PREFIX = "fsdpbench"
TBF_BURST_BYTES = 256 * 1024  # the token bucket's size (tc "256kb"): bytes that pass at line rate when it is full
SUBNET = "10.213.7."  # .1 rank 0, .2 rank 1; exists only inside our two namespaces
ALL_CONFIGS = ("fsdp2_eager", "compiled", "inductor_builtin", "inductor_overlap", "inductor_manual", "fsdp_passes",
               "fsdp_passes_separate", "fsdp_passes_manual", "compute_only", "comm_only")
DEFAULT_CONFIGS = tuple(c for c in ALL_CONFIGS if c not in ("inductor_overlap", "inductor_manual"))
OURS = ("fsdp_passes", "fsdp_passes_separate", "fsdp_passes_manual")
INDUCTOR = ("inductor_builtin", "inductor_overlap", "inductor_manual")
# Step-time targets of the balanced run: (reference, limit on ours / reference, description)
TARGETS = (("compiled", 0.75, "<= 0.75 x compiled without passes"),
           ("inductor_builtin", 0.85, "<= 0.85 x Inductor built-ins"),
           ("fsdp2_eager", 0.8, "<= 0.8 x FSDP2 eager"),
           ("bound", 1.10, "<= 1.10 x the bound max(compute, comm)"))
#: against the fastest Inductor configuration timed: (limit when balanced, limit when compute- or comm-bound)
BEST_INDUCTOR_LIMITS = (0.95, 1.00)
INDUCTOR_BUILTIN_PASSES = ["reorder_compute_for_overlap", "sink_waits", "raise_comms"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="400mbit", help="tbf rate of each veth end (tc syntax), default 400mbit")
    p.add_argument("--model", choices=("mlp", "llama"), default="mlp",
                   help="mlp (fsdp_passes.testing.build_mlp, default) or llama (build_llama)")
    p.add_argument("--layers", type=int, default=None, help="blocks (default 8 MLP, 4 Llama)")
    p.add_argument("--dim", type=int, default=None, help="model width (default 512 MLP, 256 Llama)")
    p.add_argument("--hidden", type=int, default=None,
                   help="MLP hidden width / Llama feed-forward width (default 1024 MLP, 768 Llama)")
    p.add_argument("--heads", type=int, default=8, help="Llama attention heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=4, help="Llama key/value heads (default 4)")
    p.add_argument("--vocab", type=int, default=4096, help="Llama vocabulary (default 4096)")
    p.add_argument("--seq", type=int, default=128, help="Llama sequence length (default 128)")
    p.add_argument("--batch", type=int, default=None,
                   help="per rank per step: MLP rows (default 1792) or Llama sequences (default 8)")
    p.add_argument("--balanced", action="store_true",
                   help="choose the batch from a measured probe so that a step's compute takes "
                        "--compute-over-comm times as long as its communication (overrides --batch)")
    p.add_argument("--compute-over-comm", type=float, default=1.0,
                   help="with --balanced: compute / communication of the chosen batch (default 1: balanced; "
                        "2 compute-bound, 0.5 communication-bound)")
    p.add_argument("--no-reshard", dest="reshard", action="store_false",
                   help="keep gathered parameters from forward to backward (reshard_after_forward=False) in "
                        "every configuration; default: reshard after forward, so backward gathers again")
    p.add_argument("--steps", type=int, default=12, help="timed steps per configuration (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first (default 2)")
    p.add_argument("--profiled-steps", type=int, default=3,
                   help="untimed steps per configuration profiled for backward waits, after the timed ones; the "
                        "median is reported (default 3)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated subset of {','.join(ALL_CONFIGS)} (default: all but inductor_overlap "
                        "and inductor_manual)")
    p.add_argument("--kernel-profile", action="store_true",
                   help="compile with Inductor's cpp.enable_kernel_profile, so the profiled steps' time breakdown "
                        "names each generated kernel (it adds a profiler range per kernel call to every "
                        "compiled configuration)")
    p.add_argument("--memory-budget", default="100%",
                   help="fsdp_passes memory_budget (default 100%%: one layer's parameters prefetched)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, 2 timed steps, fsdp2_eager and fsdp_passes only (quick check)")
    p.add_argument("--out", default=None, help=f"JSON output (default {DEFAULT_OUT.relative_to(REPO)})")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace name prefix (default fsdpbench)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the ranks are killed")
    p.add_argument("--cache-dir", default=None,
                   help="TORCHINDUCTOR_CACHE_DIR (default: $TORCHINDUCTOR_CACHE_DIR or /tmp/fsdp_passes_bench_inductor)")
    # internal: set by the launcher for the processes it starts inside the namespaces
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--params-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = {"mlp": dict(layers=8, dim=512, hidden=1024, batch=1792),
                "llama": dict(layers=4, dim=256, hidden=768, batch=8)}[args.model]
    if args.smoke:
        defaults = {"mlp": dict(layers=2, dim=64, hidden=128, batch=16),
                    "llama": dict(layers=2, dim=64, hidden=128, batch=2)}[args.model]
        args.heads, args.kv_heads, args.vocab, args.seq = 4, 2, 128, 16
        args.steps, args.warmup, args.profiled_steps = 2, 1, 1
        if args.configs == ",".join(DEFAULT_CONFIGS):
            args.configs = "fsdp2_eager,fsdp_passes"
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.compute_over_comm <= 0:
        p.error(f"--compute-over-comm must be positive, got {args.compute_over_comm}")
    args.config_list = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(args.config_list) - set(ALL_CONFIGS))
    if unknown:
        p.error(f"unknown configuration(s) {', '.join(unknown)}; known: {', '.join(ALL_CONFIGS)}")
    if args.timeout is None:
        args.timeout = 300.0 if args.smoke else 3600.0
    return args


# ==================================================================================================
# Launcher: namespaces, veth, tbf, two rank processes, the table and the JSON.
# ==================================================================================================

class Cluster:
    """Two network namespaces joined by a rate-limited veth pair; ``close()`` removes everything."""

    def __init__(self, prefix: str, rate: str, script: Path | None = None) -> None:
        self.script = (script or Path(__file__)).resolve()  # what each rank runs (with --rank R)
        tag = f"{prefix}-{os.getpid()}"
        self.namespaces = [f"{tag}-0", f"{tag}-1"]
        self.veths = [f"fb{os.getpid()}a", f"fb{os.getpid()}b"]  # <= 15 characters
        self.addrs = [SUBNET + "1", SUBNET + "2"]
        self.rate = rate
        self.tbf = ["tbf", "rate", rate, "burst", f"{TBF_BURST_BYTES // 1024}kb", "latency", "200ms"]
        self.procs: list[subprocess.Popen] = []
        self._closed = False

    def open(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)
        _ip("link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1])
        for ns, veth, addr in zip(self.namespaces, self.veths, self.addrs):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", veth)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", veth, "up")
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", *self.tbf])

    def spawn(self, rank: int, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        cmd = ["ip", "netns", "exec", self.namespaces[rank], sys.executable, str(self.script), *argv]
        env = dict(env, GLOO_SOCKET_IFNAME=self.veths[rank], MASTER_ADDR=self.addrs[0], MASTER_PORT="29511")
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the rank's own session: it and its children
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.namespaces:  # deleting a namespace deletes the veth end inside it (and its peer)
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        for veth in self.veths:  # only left in the root namespace if open() failed half-way
            if subprocess.run(["ip", "link", "show", veth], capture_output=True).returncode == 0:
                subprocess.run(["ip", "link", "delete", veth], capture_output=True)


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")


def _ip(*args: str) -> None:
    _run(["ip", *args])


def remove_stale_namespaces(prefix: str) -> list[str]:
    """Delete ``<prefix>-<pid>-<r>`` namespaces whose launcher process is gone (e.g. after SIGKILL)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.rsplit("-", 2)
        if len(parts) != 3 or parts[0] != prefix or not parts[1].isdigit():
            continue
        if not os.path.exists(f"/proc/{parts[1]}"):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            removed.append(name)
    return removed


def requirements_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2) on the PATH"
    return None


def launch(args: argparse.Namespace) -> int:
    return run_two_ranks(args, name="emulated_cluster", script=Path(__file__), default_out=DEFAULT_OUT,
                         summarize=summarize, print_table=print_table)


def run_two_ranks(args: argparse.Namespace, *, name: str, script: Path, default_out: Path,
                  summarize: Callable[[argparse.Namespace, list[dict]], dict],
                  print_table: Callable[[dict], None]) -> int:
    """A benchmark's launcher: the two namespaces, ``script --rank R`` in each (``rank_entry``), then the
    summary of both ranks' results as a table and a JSON file (``args.out``, else ``default_out``).  The
    namespaces and the work folder are removed on every exit path.  Returns the exit status (2: no root or
    tools, 3: namespaces failed, 4: timeout, 5: a rank failed)."""
    why = requirements_missing()
    if why:
        print(f"{name}: {why}", file=sys.stderr)
        return 2
    out_path = Path(args.out) if args.out else default_out
    cache_dir = args.cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "/tmp/fsdp_passes_bench_inductor"
    work = Path(tempfile.mkdtemp(prefix=f"{name}_"))
    cluster = Cluster(args.prefix, args.rate, script=script)
    load_start = os.getloadavg()

    def on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    atexit.register(cluster.close)
    try:
        remove_stale_namespaces(args.prefix)
        try:
            cluster.open()
        except RuntimeError as e:
            print(f"{name}: cannot set up the namespaces: {e}", file=sys.stderr)
            return 3
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        params = work / "params.json"
        params.write_text(json.dumps({**vars(args), "work": str(work)}, default=str))
        logs = [work / f"rank{r}.log" for r in range(2)]
        results = [work / f"rank{r}.json" for r in range(2)]
        procs = [cluster.spawn(r, ["--rank", str(r), "--params-json", str(params), "--result-file",
                                   str(results[r])], env, logs[r]) for r in range(2)]
        print(f"{name}: namespaces {', '.join(cluster.namespaces)}; link {args.rate} (tbf each way); "
              f"logs in {work}", flush=True)
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                print(f"{name}: ranks did not finish within {args.timeout:.0f} s", file=sys.stderr)
                _print_tail(logs)
                return 4
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2)  # let the other rank report its own error too
                break
            time.sleep(0.2)
        bad = [r for r, p in enumerate(procs) if p.poll() != 0 or not results[r].exists()]
        if bad:
            print(f"{name}: rank(s) {bad} failed", file=sys.stderr)
            _print_tail(logs)
            return 5
        ranks = [json.loads(r.read_text()) for r in results]
        summary = summarize(args, ranks)
        summary["command"] = " ".join(["python", f"benchmarks/{script.name}", *sys.argv[1:]])
        summary["link"] = {"rate": args.rate, "qdisc": " ".join(cluster.tbf), "namespaces": "2 (veth pair)"}
        summary["git"] = _git_describe()
        summary["load_avg_start"], summary["load_avg_end"] = load_start, os.getloadavg()
        print_table(summary)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {out_path}")
        return 0
    finally:
        for s in previous:  # a second Ctrl-C must not interrupt the clean-up
            signal.signal(s, signal.SIG_IGN)
        cluster.close()
        for s, h in previous.items():
            signal.signal(s, h)
        shutil.rmtree(work, ignore_errors=True)


def _git_describe() -> str | None:
    r = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return r.stdout.strip() or None if r.returncode == 0 else None


def _print_tail(logs: list[Path]) -> None:
    for r, log in enumerate(logs):
        text = log.read_text(errors="replace") if log.exists() else ""
        print(f"--- rank {r} (last lines) ---\n" + "\n".join(text.splitlines()[-25:]), file=sys.stderr)


def summarize(args: argparse.Namespace, ranks: list[dict]) -> dict:
    r0 = ranks[0]
    configs: dict[str, Any] = {}
    for name in args.config_list:
        # a step takes as long as its slower rank
        times = [max(a, b) for a, b in zip(ranks[0]["times"][name], ranks[1]["times"][name])]
        median = statistics.median(times)
        quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        configs[name] = {
            "median_s": median, "min_s": min(times), "max_s": max(times),
            "p25_s": quartiles[0], "p75_s": quartiles[2], "max_over_median": max(times) / median,
            "times_s": times, "loss": [r["losses"].get(name) for r in ranks],
        }
        profiled = [r["profiled"].get(name) for r in ranks]
        if all(profiled):
            configs[name]["profiled_step"] = _combine_profiled(profiled)
    losses = {n: c["loss"] for n, c in configs.items() if c["loss"][0] is not None}
    ref = next(iter(losses.values()), None)
    max_rel = 0.0
    for vals in losses.values():
        for a, b in zip(vals, ref):
            max_rel = max(max_rel, abs(a - b) / max(abs(b), 1e-30))
    summary: dict[str, Any] = {
        "machine": r0["machine"], "model": r0["model"], "balance_probe": r0.get("balance_probe"),
        "steps": args.steps, "warmup": args.warmup, "profiled_steps": args.profiled_steps,
        "smoke": args.smoke, "order": "round-robin: every timed step runs each configuration once, rotating "
                                      "which goes first",
        "configs": configs,
        "losses_equal": bool(losses) and max_rel <= 1e-5,
        "losses_bitwise_equal": all(v == ref for v in losses.values()),
        "loss_max_rel_diff": max_rel,
        "extra": r0.get("extra", {}),
    }
    med = {n: c["median_s"] for n, c in configs.items()}
    if "compute_only" in med and "comm_only" in med:
        summary["bound_s"] = max(med["compute_only"], med["comm_only"])
        summary["compute_over_comm"] = med["compute_only"] / med["comm_only"]
    peaks = {n: c["profiled_step"]["step_peak_bytes"] for n, c in configs.items() if "profiled_step" in c}
    if "fsdp2_eager" in peaks:
        summary["peak_memory_vs_fsdp2_eager"] = {
            n: {"step_peak_ratio": v / peaks["fsdp2_eager"],
                "transient_ratio": configs[n]["profiled_step"]["transient_peak_bytes"]
                / configs["fsdp2_eager"]["profiled_step"]["transient_peak_bytes"]}
            for n, v in peaks.items() if n in OURS or n == "compiled"}
    targets = {}
    for ours_name in OURS:
        if ours_name not in med:
            continue
        ours = med[ours_name]
        for ref, limit, text in TARGETS:
            ref_value = summary.get("bound_s") if ref == "bound" else med.get(ref)
            if ref_value:
                targets[f"{ours_name}_vs_{ref}"] = {"what": f"{ours_name} {text}", "ratio": ours / ref_value,
                                                    "limit": limit, "met": ours / ref_value <= limit}
    inductor_timed = {n: med[n] for n in INDUCTOR if n in med}
    if inductor_timed:
        best = min(inductor_timed, key=inductor_timed.get)
        balanced = bool(args.balanced) and args.compute_over_comm == 1.0
        limit = BEST_INDUCTOR_LIMITS[0] if balanced else BEST_INDUCTOR_LIMITS[1]
        summary["best_inductor"] = best
        for ours_name in OURS:
            if ours_name in med:
                ratio = med[ours_name] / inductor_timed[best]
                targets[f"{ours_name}_vs_best_inductor"] = {
                    "what": f"{ours_name} <= {limit:.2f} x the fastest Inductor configuration ({best})"
                            f"{' when balanced' if balanced else ''}",
                    "ratio": ratio, "limit": limit, "met": ratio <= limit,
                    **paired_ratios(configs[ours_name]["times_s"], configs[best]["times_s"])}
    summary["targets"] = targets
    return summary


def paired_ratios(ours: list[float], reference: list[float]) -> dict:
    """Step time ratios round by round (the i-th timed step of each ran in the same round, back to back, so a
    slow spell of the host hits both): their median and quartiles, and in how many rounds ours was faster.
    The ratio of the medians hides how much the two overlap; this says it."""
    if len(ours) != len(reference) or not ours:
        raise ValueError(f"paired_ratios: need equally many rounds, got {len(ours)} and {len(reference)}")
    ratios = [a / b for a, b in zip(ours, reference)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"paired_ratio_median": statistics.median(ratios), "paired_ratio_p25": quartiles[0],
            "paired_ratio_p75": quartiles[2], "rounds_ours_faster": sum(r < 1 for r in ratios),
            "rounds": len(ratios)}


def _combine_profiled(per_rank: list[dict]) -> dict:
    """One configuration's profiled steps on both ranks: memory per rank and the larger of the two; backward
    time and exposed communication of the slower rank (its backward ends the step)."""
    slower = max(per_rank, key=lambda p: p["backward_s"])
    return {
        "step_peak_bytes": max(p["step_peak_bytes"] for p in per_rank),
        "transient_peak_bytes": max(p["transient_peak_bytes"] for p in per_rank),
        "state_bytes": max(p["state_bytes"] for p in per_rank),
        "backward_s": slower["backward_s"], "backward_wait_s": slower["backward_wait_s"],
        "forward_wait_s": slower["forward_wait_s"], "per_rank": per_rank,
    }


def print_table(s: dict) -> None:
    m = s["model"]
    print(f"\nmodel: {m['describe']}, batch {m['batch']} per rank, {m['param_bytes'] / 2**20:.1f} MiB of fp32 "
          f"parameters, reshard after forward {m['reshard_after_forward']}; {s['steps']} timed steps per "
          "configuration")
    if s.get("balance_probe"):
        b = s["balance_probe"]
        print(f"batch chosen by the probe: compute {b['compute_s']:.3f} s at batch {b['probe_batch']}, "
              f"communication {b['comm_s']:.3f} s, compute / comm wanted {b['compute_over_comm']} "
              f"-> batch {b['batch']}")
    print(f"{'configuration':<22}{'median s':>9}{'min s':>8}{'max s':>8}{'max/med':>8}{'bwd s':>7}{'bwd wait s':>11}"
          f"{'peak MiB':>9}  {'loss (rank 0)':>15}  {'loss (rank 1)':>15}")
    for name, c in s["configs"].items():
        l0, l1 = (f"{v:.9g}" if v is not None else "-" for v in c["loss"])
        prof = c.get("profiled_step")
        wait_s = prof["backward_wait_s"] if prof else None
        bwd, wait, peak = ((f"{prof['backward_s']:.3f}", "-" if wait_s is None else f"{wait_s:.3f}",
                            f"{prof['step_peak_bytes'] / 2**20:.1f}") if prof else ("-", "-", "-"))
        print(f"{name:<22}{c['median_s']:>9.3f}{c['min_s']:>8.3f}{c['max_s']:>8.3f}{c['max_over_median']:>8.2f}"
              f"{bwd:>7}{wait:>11}{peak:>9}  {l0:>15}  {l1:>15}")
    profiled = {n: c["profiled_step"]["per_rank"] for n, c in s["configs"].items() if c.get("profiled_step")}
    if profiled:
        categories = list(next(iter(profiled.values()))[0]["self_ms_by_category"])
        print("where the profiled step went, ms (the stepping thread's self time by op, median of the profiled "
              "steps; rank 0 / rank 1)")
        print(f"{'configuration':<22}{'step':>15}" + "".join(f"{c:>23}" for c in categories))
        for name, ranks in profiled.items():
            step = " / ".join(f"{1e3 * r['step_s']:.0f}" for r in ranks)
            cells = "".join(format(" / ".join(f"{r['self_ms_by_category'][c]:.0f}" for r in ranks), ">23")
                            for c in categories)
            print(f"{name:<22}{step:>15}{cells}")
    if "bound_s" in s:
        print(f"{'bound max(compute, comm)':<27}{s['bound_s']:.3f} s (compute / comm {s['compute_over_comm']:.2f})")
    for name, r in s.get("peak_memory_vs_fsdp2_eager", {}).items():
        print(f"  peak memory {name} / fsdp2_eager: step peak {r['step_peak_ratio']:.3f}, "
              f"transient {r['transient_ratio']:.3f}")
    print(f"losses equal across configurations: {s['losses_equal']} (bitwise: {s['losses_bitwise_equal']}, "
          f"max relative difference {s['loss_max_rel_diff']:.2e})")
    for t in s["targets"].values():
        paired = (f"; round by round {t['paired_ratio_median']:.3f} ({t['paired_ratio_p25']:.3f}-"
                  f"{t['paired_ratio_p75']:.3f}), faster in {t['rounds_ours_faster']} of {t['rounds']}"
                  if "paired_ratio_median" in t else "")
        print(f"  {'MET   ' if t['met'] else 'MISSED'} {t['what']}: ratio {t['ratio']:.3f} (limit {t['limit']}){paired}")


# ==================================================================================================
# Rank: runs inside a namespace, one compute thread, gloo over the veth.
# ==================================================================================================

def rank_main(args: argparse.Namespace) -> int:
    return rank_entry(args, ("model", "layers", "dim", "hidden", "heads", "kv_heads", "vocab", "seq", "batch",
                             "balanced", "compute_over_comm", "steps", "warmup", "profiled_steps", "kernel_profile",
                             "memory_budget", "rate", "reshard", "config_list"), _benchmark)


def rank_entry(args: argparse.Namespace, keys: tuple[str, ...],
               benchmark: Callable[[argparse.Namespace, int], dict]) -> int:
    """One rank of ``run_two_ranks``: one compute thread, the launcher's ``keys`` read from its params file
    into ``args``, the gloo group over the veth, ``benchmark(args, rank)``'s result written as JSON."""
    import torch

    torch.set_num_threads(1)
    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    from datetime import timedelta

    inductor_config.compile_threads = 1
    # one gloo worker thread unless BENCH_GLOO_THREADS says otherwise: with torch's two, collectives in flight
    # together corrupt the heap now and then (gloo_view_race.py); with one a rank's collectives run in issue
    # order, as NCCL runs a group's on its stream and as the simulator models them
    import _common  # noqa: F401  (puts this checkout's fsdp_passes first on sys.path)
    from fsdp_passes.testing.gloo import set_gloo_worker_threads

    set_gloo_worker_threads(int(os.environ.get("BENCH_GLOO_THREADS", "1")))
    params = json.loads(Path(args.params_json).read_text())
    for key in keys:
        setattr(args, key, params[key])
    dist.init_process_group("gloo", init_method="env://", rank=args.rank, world_size=2,
                            timeout=timedelta(seconds=900))
    try:
        out = benchmark(args, args.rank)
        Path(args.result_file).write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _machine() -> dict:
    import torch

    from _common import machine  # benchmarks/ is this script's folder, so it is on sys.path

    return {**machine(), "threads_per_rank": torch.get_num_threads()}


#: share of the shaped rate that carries TCP payload: tbf counts whole frames, and a full 1500-byte-MTU frame
#: is 1514 bytes (14 Ethernet, 20 IP, 32 TCP with timestamps) around 1448 of payload
TCP_PAYLOAD_FRACTION = 1448 / 1514


def _link_profile(rate: str, gflops: float, latency_us: tuple[float, float]) -> dict:
    """An fsdp_passes cluster profile for this link and this CPU thread (same on both ranks): the link's rate
    (its TCP payload share, ``TCP_PAYLOAD_FRACTION``), the thread's FLOP/s and the link's latencies, a base and
    one per ring step (``_measure_link_latency_us``)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    text = rate.lower()
    bits = None
    for suffix, factor in units.items():
        if text.endswith(suffix):
            bits = float(text[: -len(suffix)]) * factor
            break
    gbytes = (bits or 400e6) / 8 / 1e9 * TCP_PAYLOAD_FRACTION
    base_us, step_us = latency_us
    latencies = {f"{algo}_base_latency_{proto}_us": base_us for algo in ("ring", "tree") for proto in ("simple", "ll")}
    latencies.update({f"{where}_hop_latency_{proto}_us": step_us for where in ("intra", "inter")
                      for proto in ("simple", "ll")})
    return {"base": "cpu-gloo", "intra_node_bw_gbps": gbytes, "inter_node_bw_per_nic_gbps": gbytes,
            "tflops_float32": gflops / 1e3, **latencies}


def _measure_link_latency_us(calls: int = 30) -> tuple[float, float]:
    """The link's latencies from small collectives over the default group: ``(base, per ring step)`` in µs.

    Between two ranks a ring all-gather takes one step and an all-reduce two, so the fastest 1 KiB
    all-reduce minus the fastest 1 KiB all-gather is one step (gloo's TCP round trip through the namespaces
    and the shaped veth pair, about 0.3 ms against loopback's 0.05), and the all-gather minus that step is
    the base.  The fastest, not the median: on a loaded 2-core host the median measures the wait for a core.
    Every rank takes part; the caller shares rank 0's figures."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    small = torch.zeros(256)
    gathered = torch.zeros(256 * world)

    def fastest(call: Any) -> float:
        for _ in range(3):
            call()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e6

    gather_us = fastest(lambda: dist.all_gather_into_tensor(gathered, small))
    reduce_us = fastest(lambda: dist.all_reduce(small))
    step_us = max(reduce_us - gather_us, 1.0)  # a profile's latencies are positive; timing noise can tie them
    return max(gather_us - step_us, 1.0), step_us


def _measure_gflops() -> float:
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    n, best = 20, float("inf")
    for _ in range(5):  # the fastest of 5 timings: one timing moved by 25 % between runs on a loaded host
        t0 = time.perf_counter()
        for _ in range(n):
            a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 512**3 * n / best / 1e9


class _Config:
    def __init__(self, name: str, step: Callable[[], Any], context: Callable[[], Any]) -> None:
        self.name, self.step, self.context = name, step, context


class _Workload:
    """The timed model: how to build it (unsharded, or SimpleFSDP with options), its inputs for a batch, its
    loss, and the bucket plans per block (ours as a pattern, Inductor's manual pass as one entry per block)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        n = args.layers
        if args.model == "mlp":
            self.describe = f"MLP, {n} layers, dim {args.dim}, hidden {args.hidden}"
            self.ours_plan: list = [f"layers.[0-{n - 1}]"]
            self.inductor_plan: list = [f"layers.{i}" for i in range(n)]
            self.probe_batch, self.batch_multiple = 1024, 64  # rows
        else:
            self.describe = (f"Llama, {n} layers, dim {args.dim}, {args.heads} heads ({args.kv_heads} kv), "
                             f"feed-forward {args.hidden}, vocab {args.vocab}, {args.seq} tokens per sequence")
            self.ours_plan = ["tok_embeddings", f"layers.[0-{n - 1}]", ["norm", "output"]]
            from _inductor_peers import llama_block_plan  # this script's folder (sys.path), torch on import

            self.inductor_plan = llama_block_plan(n)
            self.probe_batch, self.batch_multiple = 8, 1  # sequences

    def build(self, fsdp: bool = True, **fsdp_options: Any) -> Any:
        from fsdp_passes.testing import build_llama, build_mlp

        a = self.args
        if a.model == "mlp":
            return build_mlp(n_layers=a.layers, dim=a.dim, hidden=a.hidden, seed=0, fsdp=fsdp, **fsdp_options)
        return build_llama(n_layers=a.layers, dim=a.dim, n_heads=a.heads, n_kv_heads=a.kv_heads, ffn_dim=a.hidden,
                           vocab=a.vocab, seq_len=a.seq, seed=0, fsdp=fsdp, **fsdp_options)

    def inputs(self, batch: int, generator: Any) -> tuple:
        import torch

        a = self.args
        if a.model == "mlp":
            return (torch.randn(batch, a.dim, generator=generator),)
        tokens = torch.randint(0, a.vocab, (batch, a.seq + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss(self, model: Any, *inputs: Any) -> Any:
        import torch.nn.functional as F

        if self.args.model == "mlp":
            return model(inputs[0]).square().mean()
        logits = model(inputs[0])
        return F.cross_entropy(logits.flatten(0, 1), inputs[1].flatten())


def _benchmark(args: argparse.Namespace, rank: int) -> dict:
    import contextlib

    import torch
    import torch._inductor.config as inductor_config
    import torch.distributed as dist

    import fsdp_passes
    from fsdp_passes.cost_model import CostModel

    import _inductor_peers as peers

    world = dist.get_world_size()
    work = _Workload(args)
    if args.kernel_profile:
        inductor_config.cpp.enable_kernel_profile = True  # every configuration alike, before any compile

    balance_probe = None
    if args.balanced:
        balance_probe = _probe_balanced_batch(work, world, args.reshard, args.compute_over_comm)
        args.batch = balance_probe["batch"]
        print(f"rank {rank}: balance probe {balance_probe}", flush=True)
    batch_inputs = work.inputs(args.batch, torch.Generator().manual_seed(1000 + rank))

    # rank 0 measures the thread's speed; both ranks must plan with the same profile
    latency_us = _measure_link_latency_us()
    box = [(_measure_gflops(), latency_us) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    cluster = _link_profile(args.rate, *box[0])
    ours_options = dict(bucketing="auto", reorder=True, cluster=cluster, memory_budget=args.memory_budget)
    manual_options = dict(ours_options, bucketing="manual", bucket_plan=work.ours_plan)

    no_passes = lambda: inductor_config.patch(  # noqa: E731
        reorder_for_compute_comm_overlap=False, bucket_all_gathers_fx="none", bucket_reduce_scatters_fx="none")
    builtin = lambda: inductor_config.patch(  # noqa: E731
        reorder_for_compute_comm_overlap=True, reorder_for_compute_comm_overlap_passes=INDUCTOR_BUILTIN_PASSES,
        bucket_all_gathers_fx="all", bucket_reduce_scatters_fx="all")

    # Inductor's OverlapScheduler plans with the same profile as ours: device peaks and collective prices
    link_cost_model = CostModel.from_options(cluster)

    @contextlib.contextmanager
    def inductor_overlap() -> Any:
        with peers.device_peaks_of(link_cost_model.profile), \
                inductor_config.patch(peers.overlap_scheduling_config(link_cost_model)):
            yield

    @contextlib.contextmanager
    def inductor_manual() -> Any:  # its scheduler estimates compute with the same roofline
        with peers.device_peaks_of(link_cost_model.profile), \
                inductor_config.patch(peers.manual_overlap_config(work.inductor_plan)):
            yield

    def ours() -> Any:
        return fsdp_passes.enabled(**ours_options)

    def ours_manual() -> Any:
        return fsdp_passes.enabled(**manual_options)

    def make_step(name: str, model: torch.nn.Module, compiled: bool) -> Callable[[], Any]:
        def loss_fn(*inputs: torch.Tensor) -> torch.Tensor:
            return work.loss(model, *inputs)

        if compiled:
            # Dynamo does not guard on Inductor's config, and with nn-module inlining it would serve the first
            # configuration's graph to every model of the same structure: give each configuration its own code
            # object (so its own Dynamo cache) and therefore its own compile under its own config.
            loss_fn.__code__ = loss_fn.__code__.replace(co_name=f"loss_{name}")
        fn = torch.compile(loss_fn) if compiled else loss_fn

        def step() -> float:
            for p in model.parameters():
                p.grad = None
            with torch.profiler.record_function(FORWARD_RANGE):  # labels for the profiled steps; free otherwise
                loss = fn(*batch_inputs)
            with torch.profiler.record_function(BACKWARD_RANGE):
                loss.backward()
            return loss.item()

        return step

    configs: list[_Config] = []
    models: dict[str, torch.nn.Module] = {}
    param_bytes = sum(p.numel() * 4 for p in work.build(fsdp=False).parameters())
    for name in args.config_list:
        if name == "fsdp2_eager":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            model = work.build(fsdp=False)
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=args.reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=args.reshard)
            configs.append(_Config(name, make_step(name, model, compiled=False), contextlib.nullcontext))
            models[name] = model
        elif name in ("compiled", *INDUCTOR, *OURS):
            # "separate": every rank creates the second process group here, in the same configuration order
            rs_group = "separate" if name == "fsdp_passes_separate" else None
            model = work.build(reshard_after_forward=args.reshard, reduce_scatter_group=rs_group)
            context = {"compiled": no_passes, "inductor_builtin": builtin, "inductor_overlap": inductor_overlap,
                       "inductor_manual": inductor_manual, "fsdp_passes": ours,
                       "fsdp_passes_separate": ours, "fsdp_passes_manual": ours_manual}[name]
            configs.append(_Config(name, make_step(name, model, compiled=True), context))
            models[name] = model
        elif name == "compute_only":
            model = work.build(fsdp=False)
            configs.append(_Config(name, make_step(name, model, compiled=True), no_passes))
            models[name] = model
        elif name == "comm_only":
            step = _comm_only_step(work.build(fsdp=False), world, args.reshard)
            configs.append(_Config(name, step, contextlib.nullcontext))

    times: dict[str, list[float]] = {c.name: [] for c in configs}
    losses: dict[str, float] = {}
    compile_s: dict[str, float] = {}
    from torch._dynamo.utils import counters

    graphs: dict[str, int] = {}
    pass_reports: dict[str, list[str]] = {}
    pass_reports_raw: dict[str, list[Any]] = {}
    for c in configs:  # warm-up (compiles) one configuration at a time
        t0 = time.perf_counter()
        before = counters["stats"]["unique_graphs"]
        fsdp_passes.last_reports(clear=True)
        for _ in range(args.warmup):
            with c.context():
                dist.barrier()
                loss = c.step()
        compile_s[c.name] = time.perf_counter() - t0
        graphs[c.name] = counters["stats"]["unique_graphs"] - before
        if c.name in OURS:
            reports = fsdp_passes.last_reports()
            pass_reports[c.name] = [r.one_line() for r in reports]
            pass_reports_raw[c.name] = reports
            if not any(r.pass_name == "scheduler" for r in reports) or any(r.fallback for r in reports):
                raise RuntimeError(f"{c.name}: the passes did not run (or fell back): {pass_reports[c.name]}")
        if loss is not None:
            losses[c.name] = loss
        print(f"rank {rank}: {c.name} warmed up in {compile_s[c.name]:.1f} s, loss {loss}", flush=True)
    for i in range(args.steps):
        k = i % len(configs)
        for c in configs[k:] + configs[:k]:  # round robin, rotating which configuration goes first
            with c.context():
                dist.barrier()
                t0 = time.perf_counter()
                loss = c.step()
                times[c.name].append(time.perf_counter() - t0)
            if loss is not None and loss != losses[c.name]:
                raise RuntimeError(f"{c.name}: loss changed between steps ({losses[c.name]} -> {loss})")
        if rank == 0:
            print(f"step {i}: " + ", ".join(f"{n} {t[-1]:.3f}s" for n, t in times.items()), flush=True)
    # untimed profiled steps: memory first (its window must not see frees of tensors a profiled step of the
    # same configuration allocated), then waits without the memory profiler's per-allocation overhead
    memory: dict[str, dict] = {}
    for c in configs:
        if c.name in models:
            with c.context():
                dist.barrier()
                memory[c.name] = _profile_memory(c.step, models[c.name])
    wait_samples: dict[str, list[dict]] = {name: [] for name in models}
    profiled_configs = [c for c in configs if c.name in models]
    for i in range(args.profiled_steps):
        k = i % len(profiled_configs)
        for c in profiled_configs[k:] + profiled_configs[:k]:  # alternated like the timed steps
            with c.context():
                dist.barrier()
                wait_samples[c.name].append(_profile_waits(c.step))
    profiled = {name: {**memory[name], **_median_waits(samples)} for name, samples in wait_samples.items()}
    extra: dict[str, Any] = {"warmup_s": compile_s, "dynamo_graphs_compiled": graphs, "thread_gflops": box[0],
                             "simulated_backward_exposed_comm_ms": _simulated_backward_exposed(pass_reports_raw),
                             "fsdp_passes_options": ours_options, "fsdp_passes_manual_options": manual_options,
                             "fsdp_passes_reports": pass_reports,
                             "inductor_builtin_passes": INDUCTOR_BUILTIN_PASSES,
                             "inductor_overlap": peers.OVERLAP_SCHEDULING_NOTE,
                             "inductor_manual_plan": work.inductor_plan}
    return {
        "rank": rank, "times": times, "losses": losses, "machine": _machine(), "extra": extra,
        "profiled": profiled, "balance_probe": balance_probe,
        "model": {"kind": f"{args.model} (fsdp_passes.testing.build_{args.model}), fp32", "describe": work.describe,
                  "reshard_after_forward": args.reshard, "layers": args.layers, "dim": args.dim,
                  "hidden": args.hidden, "batch": args.batch, "param_bytes": param_bytes,
                  **({"heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab, "seq": args.seq}
                     if args.model == "llama" else {}),
                  "loss": ("mean(model(x)**2)" if args.model == "mlp" else "cross-entropy of next tokens")
                  + ", forward + backward, no optimizer"},
    }


FORWARD_RANGE = "emulated_cluster::forward"
BACKWARD_RANGE = "emulated_cluster::backward"
WAIT_OPS = ("_c10d_functional::wait_tensor",)  # compiled configurations: where the thread blocks on a collective


def _state_bytes(model: Any) -> int:
    """Bytes of the storages holding the model's parameters on this rank (the local shard of a sharded one,
    padding included), each storage once."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        t = p._local_tensor if hasattr(p, "_local_tensor") else p  # DTensor parameters: this rank's shard
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _profile_memory(step: Callable[[], Any], model: Any) -> dict:
    """One step under ``torch.profiler`` with ``profile_memory``: the peak of the running sum of the tensor
    allocations and frees the step makes (``[memory]`` events of the CPU allocator, every thread the profiler
    sees), above what was allocated when it started.  Frees of tensors allocated before the window (last
    step's gradients, dropped at the start of this one) are not reported by the allocator, so the window
    starts without them.  Memory that gloo allocates outside torch's allocator is not seen."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    state = _state_bytes(model)
    return {"transient_peak_bytes": peak, "state_bytes": state, "step_peak_bytes": state + peak,
            "memory_events": len(events)}


def _profile_waits(step: Callable[[], Any]) -> dict:
    """One step under ``torch.profiler``: backward's wall time and the time the rank's thread spent in
    collective waits inside forward and backward (exposed communication: transfers not hidden by compute)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.profiler.kineto_results.events()
    ranges = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in (FORWARD_RANGE, BACKWARD_RANGE)}
    waits = {FORWARD_RANGE: 0.0, BACKWARD_RANGE: 0.0}
    each_wait_ms: dict[str, list[float]] = {FORWARD_RANGE: [], BACKWARD_RANGE: []}  # in issue order
    wait_names: dict[str, int] = {}
    for e in sorted(events, key=lambda e: e.start_ns()):
        if "wait" in e.name().lower():
            wait_names[e.name()] = wait_names.get(e.name(), 0) + 1
        if e.name() not in WAIT_OPS:
            continue
        for label, (start, end) in ranges.items():
            if start <= e.start_ns() <= end:
                waits[label] += (e.end_ns() - e.start_ns()) / 1e9
                each_wait_ms[label].append(round((e.end_ns() - e.start_ns()) / 1e6, 3))
    bstart, bend = ranges[BACKWARD_RANGE]
    fstart = ranges[FORWARD_RANGE][0]
    # every functional collective and wait the step ran, in order: [op, start ms, end ms] from forward's start
    timeline = [[e.name().split("::")[-1], round((e.start_ns() - fstart) / 1e6, 3),
                 round((e.end_ns() - fstart) / 1e6, 3)]
                for e in sorted(events, key=lambda e: e.start_ns())
                if e.name().startswith("_c10d_functional::") and fstart <= e.start_ns() <= bend]
    # None where the step has no functional waits (FSDP2 eager waits inside its hooks; compute_only never waits)
    seen = any(n in wait_names for n in WAIT_OPS)
    return {"backward_s": (bend - bstart) / 1e9, "backward_wait_s": waits[BACKWARD_RANGE] if seen else None,
            "forward_wait_s": waits[FORWARD_RANGE] if seen else None, "wait_events": wait_names,
            "forward_waits_ms": each_wait_ms[FORWARD_RANGE], "backward_waits_ms": each_wait_ms[BACKWARD_RANGE],
            "step_s": (bend - fstart) / 1e9, "collective_timeline": timeline, **_main_thread_breakdown(prof)}


#: where the stepping thread's time goes, by the op an event's self time belongs to (first match wins)
TIME_CATEGORIES = (
    ("collective_wait", lambda n: n in WAIT_OPS),
    ("collective_issue", lambda n: n.startswith(("_c10d_functional::", "c10d::", "c10d_functional::"))),
    ("bucket_copy_ours", lambda n: n.startswith("fsdp_passes::")),
    ("bucket_copy_inductor", lambda n: n.startswith("bucketing::")),
    ("matmul", lambda n: n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                               "aten::linear") or "scaled_dot_product" in n),
    ("generated_kernel", lambda n: "cpp_fused" in n),  # graph_<id>_cpp_fused_..., with --kernel-profile
)


def _main_thread_breakdown(prof: Any, top: int = 60) -> dict:
    """The stepping thread's time from forward's start to backward's end split by the op it was spent in (each
    event's self time: its duration less its children's), summed per category of ``TIME_CATEGORIES``
    ("other": Python, dispatch, autograd and, without ``--kernel-profile``, the generated kernels, which then
    record no range of their own), and the ``top`` names by self time."""
    every = list(prof.events())
    main = next(e.thread for e in every if e.name == FORWARD_RANGE)  # the profiler's id, not the OS thread's
    events = [e for e in every if e.thread == main]
    ranges = {e.name: e.time_range for e in events if e.name in (FORWARD_RANGE, BACKWARD_RANGE)}
    start, end = ranges[FORWARD_RANGE].start, ranges[BACKWARD_RANGE].end
    by_name: dict[str, float] = {}
    for e in events:
        if e.name in ranges or not (start <= e.time_range.start and e.time_range.end <= end):
            continue
        by_name[e.name] = by_name.get(e.name, 0.0) + e.self_cpu_time_total / 1e3
    by_category = {name: 0.0 for name, _ in TIME_CATEGORIES} | {"other": 0.0}
    for name, ms in by_name.items():
        category = next((c for c, match in TIME_CATEGORIES if match(name)), "other")
        by_category[category] += ms
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"self_ms_by_category": {k: round(v, 3) for k, v in by_category.items()},
            "self_ms_top": {k: round(v, 3) for k, v in ranked}}


def _median_waits(samples: list[dict]) -> dict:
    """The median over profiled steps of backward time and waits (None stays None), with every sample."""
    out: dict[str, Any] = {"wait_events": samples[0]["wait_events"], "samples": samples}
    for key in ("backward_s", "backward_wait_s", "forward_wait_s"):
        values = [s[key] for s in samples]
        out[key] = None if None in values else statistics.median(values)
    out["step_s"] = statistics.median(s["step_s"] for s in samples)
    out["self_ms_by_category"] = {k: statistics.median(s["self_ms_by_category"][k] for s in samples)
                                  for k in samples[0]["self_ms_by_category"]}
    return out


def _simulated_backward_exposed(reports: dict[str, list[Any]]) -> dict[str, float]:
    """The scheduler pass's simulated exposed communication of each configuration's backward graph (ms)."""
    out = {}
    for name, rs in reports.items():
        for r in rs:
            if r.pass_name == "scheduler" and "bwd" in r.graph:
                out[name] = r.exposed_comm_ms_after
    return out


def choose_balanced_batch(probe_batch: int, compute_s: float, comm_s: float, multiple: int = 64,
                          compute_over_comm: float = 1.0) -> int:
    """The batch at which a step's compute (proportional to the batch) takes ``compute_over_comm * comm_s``,
    given that it took ``compute_s`` at ``probe_batch``; rounded to a multiple of ``multiple``, at least
    ``multiple``."""
    if compute_s <= 0 or comm_s <= 0:
        raise ValueError(f"choose_balanced_batch: times must be positive (compute {compute_s}, comm {comm_s})")
    if compute_over_comm <= 0:
        raise ValueError(f"choose_balanced_batch: compute_over_comm must be positive, got {compute_over_comm}")
    wanted = probe_batch * compute_over_comm * comm_s / compute_s
    return max(multiple, round(wanted / multiple) * multiple)


def _probe_balanced_batch(work: "_Workload", world: int, reshard: bool, compute_over_comm: float) -> dict:
    """Times one step's compute (the unsharded model, eager, at the workload's probe batch) and one step's
    collectives on the link (``_comm_only_step``) on both ranks at once, as the benchmark runs them; the
    slower rank's medians decide (the same batch on both ranks)."""
    import torch
    import torch.distributed as dist

    full_model = work.build(fsdp=False)
    probe_inputs = work.inputs(work.probe_batch, torch.Generator().manual_seed(7))

    def compute_step() -> None:
        for p in full_model.parameters():
            p.grad = None
        work.loss(full_model, *probe_inputs).backward()

    def timed(fn: Callable[[], Any], n: int) -> list[float]:
        fn()  # warm-up
        out = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    compute_times = timed(compute_step, 3)
    comm_times = timed(_comm_only_step(full_model, world, reshard), 3)
    slowest = torch.tensor([statistics.median(compute_times), statistics.median(comm_times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    compute_s, comm_s = slowest.tolist()
    return {"probe_batch": work.probe_batch, "compute_s": compute_s, "comm_s": comm_s,
            "compute_over_comm": compute_over_comm,
            "batch": choose_balanced_batch(work.probe_batch, compute_s, comm_s, work.batch_multiple,
                                           compute_over_comm),
            "compute_times_s": compute_times, "comm_times_s": comm_times,
            "how": "median of 3 steps after a warm-up, slower rank; compute: unsharded model, eager"}


def _comm_only_step(full_model: Any, world: int, reshard: bool) -> Callable[[], None]:
    """The collectives of one SimpleFSDP step, same sizes and order, no compute: forward all-gathers, then in
    reverse layer order the backward re-gathers (when resharding after forward) and the gradient
    reduce-scatters, all issued asynchronously and waited on at the end, so the link never idles for lack of
    work."""
    import torch
    import torch.distributed as dist

    shapes = [tuple(p.shape) for p in full_model.parameters()]
    shards = [torch.randn(s[0] // world, *s[1:]) for s in shapes]
    gathered = [torch.empty(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    grad_shards = [torch.empty(s[0] // world, *s[1:]) for s in shapes]
    order = list(range(len(shapes)))

    def step() -> None:
        works = [dist.all_gather_into_tensor(gathered[i], shards[i], async_op=True) for i in order]
        for i in reversed(order):
            if reshard:
                works.append(dist.all_gather_into_tensor(gathered[i], shards[i], async_op=True))
            works.append(dist.reduce_scatter_tensor(grad_shards[i], grads[i], async_op=True))
        for w in works:
            w.wait()
        return None

    return step


def main(argv: list[str] | None = None) -> int:
    return dispatch(parse_args(argv), rank_main, launch)


def dispatch(args: argparse.Namespace, rank_main: Callable[[argparse.Namespace], int],
             launch: Callable[[argparse.Namespace], int]) -> int:
    """A benchmark script is its own rank program: with ``--rank`` it runs one rank, else it launches both."""
    return rank_main(args) if args.rank is not None else launch(args)


if __name__ == "__main__":
    sys.exit(main())
