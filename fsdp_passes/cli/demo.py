"""``python -m fsdp_passes demo``: the passes on a built-in Llama-style model, no GPU or cluster needed.

The model is sharded SimpleFSDP-style (``fsdp_passes.testing``) over a fake process group of
``world_size`` ranks, compiled forward and backward with the passes on and ``debug_dir`` set, and the
dumps are summarised.  By default the compile stops right after Inductor's scheduler passes (the
capture helper of ``fsdp_passes.testing``): everything the passes do has happened by then, and no C++
kernels need building.  ``full_compile=True`` runs a real ``torch.compile`` step instead (minutes on CPU).

When a pass falls back (it failed, or its planner is not installed) it still writes a dump of the unchanged
schedule for that graph, marked with the reason, so the numbers of the graph as compiled are visible.

The same step is first compiled with the passes doing nothing (``bucketing="none"``, ``reorder=False``;
dumps in ``<out>/baseline``): the headline compares every mode against that step, so the numbers of
auto, manual and none are comparable with each other.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import last_reports
from ..debug.tables import format_bytes, summary_table, totals
from .common import prog_name, say as _say
from .report import print_report

log = logging.getLogger("fsdp_passes")

CLUSTER_DEFAULT = "h100-nvlink"


@dataclass
class DemoConfig:
    layers: int = 4
    dim: int = 256
    world_size: int = 8
    cluster: str = CLUSTER_DEFAULT
    bucketing: str = "auto"
    out: str = "./fsdp_dumps"
    seq_len: int = 256
    batch: int = 2
    full_compile: bool = False

    def model_kwargs(self) -> dict[str, Any]:
        n_heads = 4 if self.dim < 256 else self.dim // 64
        return {
            "n_layers": self.layers,
            "dim": self.dim,
            "n_heads": n_heads,
            "n_kv_heads": max(1, n_heads // 2),
            "ffn_dim": 4 * self.dim,
            "vocab": max(8 * self.world_size, 1024 // self.world_size * self.world_size),
            "seq_len": self.seq_len,
        }

    def bucket_plan(self) -> list | None:
        """Manual bucketing: one bucket per transformer layer, plus the embedding and the head."""
        if self.bucketing != "manual":
            return None
        return ["tok_embeddings", f"layers.[0-{self.layers - 1}]", ["norm", "output"]]

    def validate(self) -> None:
        if self.layers < 1:
            raise ValueError(f"--layers {self.layers}: expected an integer >= 1")
        if self.world_size < 1:
            raise ValueError(f"--world-size {self.world_size}: expected an integer >= 1")
        kw = self.model_kwargs()
        if self.dim < 8 or self.dim % kw["n_heads"]:
            raise ValueError(f"--dim {self.dim}: expected a multiple of {kw['n_heads']}, at least 8")


BASELINE_DIR = "baseline"  # sub-folder of the dump folder: the same step compiled without any pass


@dataclass
class DemoResult:
    out: str
    baseline: str | None = None  # dumps of the step without any pass (bucketing="none", reorder=False)
    graphs: list[str] = field(default_factory=list)
    fallbacks: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


class _DemoSchedulerPass:
    """Wraps the installed scheduler pass: one progress line per graph, fallbacks noted in the result."""

    def __init__(self, inner: Any, say: Callable[[str], None], result: DemoResult):
        self.inner, self.say, self.result = inner, say, result

    def __call__(self, nodes: list) -> list:
        out = self.inner(nodes)
        report = last_reports()[-1]  # the installed pass reports every graph it sees, also when it falls back
        what = "backward" if "_bwd" in report.graph else "forward"
        if report.fallback is None:
            self.say(f"  {what} graph {report.graph}: {len(nodes)} scheduler nodes, "
                     f"{report.collectives_moved} collectives moved")
        else:  # the pass itself dumped the unchanged schedule with its numbers
            self.result.fallbacks[report.graph] = report.fallback
            self.say(f"  {what} graph {report.graph}: {len(nodes)} scheduler nodes; "
                     f"reordering fell back, the unchanged schedule is dumped ({report.fallback})")
        self.result.graphs.append(report.graph)
        if what == "forward":
            self.say("compiling backward ...")
        return out


def _clear_old_dumps(out: str) -> int:
    """Remove graph folders an earlier run left in ``out`` (only folders holding our summary.json / dag.json)."""
    removed = 0
    if not os.path.isdir(out):
        return 0
    for entry in os.listdir(out):
        path = os.path.join(out, entry)
        if os.path.isdir(path) and (os.path.isfile(os.path.join(path, "summary.json"))
                                    or os.path.isfile(os.path.join(path, "dag.json"))):
            shutil.rmtree(path)
            removed += 1
    return removed


@contextlib.contextmanager
def _quiet_torch():
    """Torch's own warnings (checkpoint under compile, deprecations) are noise in a demo."""
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    # our own warnings are reported as progress lines; without any logging configured they would also be
    # printed by logging's last-resort handler
    null = None
    if not log.handlers and not logging.getLogger().handlers:
        null = logging.NullHandler()
        log.addHandler(null)
    try:
        yield
    finally:
        torch_log.setLevel(level)
        if null is not None:
            log.removeHandler(null)


def run_demo(cfg: DemoConfig, say: Callable[[str], None] = print) -> DemoResult:
    """Build, shard and compile the demo model with the passes on; dumps go to ``cfg.out``."""
    cfg.validate()
    from ..options import Options

    options: dict[str, Any] = {"bucketing": cfg.bucketing, "cluster": cfg.cluster, "debug_dir": cfg.out}
    if cfg.bucket_plan() is not None:
        options["bucket_plan"] = cfg.bucket_plan()
    Options(**options)  # a bad cluster name / option fails here, before anything is built

    start = time.perf_counter()
    out = os.path.abspath(cfg.out)
    options["debug_dir"] = out
    os.makedirs(out, exist_ok=True)
    baseline_dir = os.path.join(out, BASELINE_DIR)
    _clear_old_dumps(baseline_dir)
    removed = _clear_old_dumps(out)
    if removed:
        say(f"removed {removed} graph dump(s) of an earlier run from {out}")
    say("importing torch ...")
    import torch
    import torch._dynamo

    import fsdp_passes
    from ..inductor.install import compile_caches_off, scheduler_pass_wrapped
    from ..testing import build_llama, capture_scheduler_nodes, example_inputs, fake_process_group

    result = DemoResult(out=out)
    kw = cfg.model_kwargs()
    with _quiet_torch(), warnings.catch_warnings(), fake_process_group(cfg.world_size):
        warnings.simplefilter("ignore")  # a pass that falls back says so in its report; torch's warnings are noise
        say(f"building a Llama-style model: {cfg.layers} layers, dim {cfg.dim}, {kw['n_heads']} heads, "
            f"ffn {kw['ffn_dim']}, vocab {kw['vocab']}, sequence {cfg.seq_len}, batch {cfg.batch}")
        say(f"sharding it with fsdp_passes.data_parallel(reshard_after_forward=True) over a fake "
            f"{cfg.world_size}-rank process group")
        model = fsdp_passes.data_parallel(build_llama(**kw, fsdp=False), reshard_after_forward=True)
        inputs = example_inputs(model, batch=cfg.batch, seed=0)
        n_params = sum(p.numel() for p in model.parameters())  # DTensor parameters: numel of the full tensor
        say(f"  {n_params / 1e6:.2f} M parameters, {len(list(model.parameters()))} sharded tensors")
        # the baseline: the same step with the passes doing nothing, so every mode is reported against it
        say("compiling the step without any pass (the baseline) ...")
        torch._dynamo.reset()
        with fsdp_passes.enabled(bucketing="none", reorder=False, cluster=cfg.cluster, debug_dir=baseline_dir):
            capture_scheduler_nodes(model, *inputs)
        result.baseline = baseline_dir
        last_reports(clear=True)
        torch._dynamo.reset()
        with fsdp_passes.enabled(**options) as opts:
            say(f"passes on: bucketing={opts.bucketing}, reorder={opts.reorder}, cluster={opts.cluster}, "
                f"memory_budget={opts.memory_budget}, debug_dir={opts.debug_dir}")
            with scheduler_pass_wrapped(lambda inner: _DemoSchedulerPass(inner, say, result)):
                if cfg.full_compile:
                    say("compiling forward with torch.compile (full Inductor compile, C++ kernels) ...")
                    with compile_caches_off():
                        compiled = torch.compile(model, fullgraph=True)
                        loss = compiled(*inputs).float().sum()
                        loss.backward()
                else:
                    say("compiling forward (Dynamo, AOTAutograd, Inductor lowering and scheduling; "
                        "stops after the scheduler passes, no kernels are built) ...")
                    capture_scheduler_nodes(model, *inputs)
        torch._dynamo.reset()
    fx_fallback = next((r.fallback for r in last_reports() if r.pass_name == "fx" and r.fallback), None)
    if fx_fallback is not None:
        say(f"note: bucketing fell back: {fx_fallback}")
    result.seconds = time.perf_counter() - start
    return result


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = DemoConfig(layers=args.layers, dim=args.dim, world_size=args.world_size, cluster=args.cluster,
                     bucketing=args.bucketing, out=args.out, full_compile=args.full_compile,
                     seq_len=args.seq_len)
    result = run_demo(cfg, say=_say)
    _say(f"done in {result.seconds:.1f} s")
    _say("")
    print_report(result.out, header=False)
    from ..debug.reader import load_dumps

    dumps = load_dumps(result.out)
    if result.baseline is not None:
        _say("")
        baseline = load_dumps(result.baseline)
        _say(_headline(baseline, dumps))
        for line in _peaks_per_graph(baseline, dumps):
            _say(line)
    _say("")
    files = dumps[0].summary.get("files") if dumps else None
    _say(f"dumps: {result.out}/<graph>/ ({', '.join(files or ['summary.json'])})")
    skipped = {k: v for d in dumps for k, v in (d.summary.get("skipped_files") or {}).items()}
    for why in skipped.values():
        _say(f"  {why}")
    for d in dumps:
        _say(f"trace: {d.file('trace.json')}  (open in https://ui.perfetto.dev)")
    _say(f"again: {prog_name()} report {result.out}")
    if result.baseline is not None:
        _say(f"graph by graph against no passes: {prog_name()} report {result.baseline} {result.out}")
    return 0


def _peaks_per_graph(baseline: list, passes: list) -> list[str]:
    """Each graph's peak without any pass -> with the passes, against the budget the passes had: the headline's
    peak is the largest graph's, which can hide a graph whose peak rose within its budget."""
    lines = ["peak memory per graph, without any pass -> with the passes (the rise is bounded by memory_budget):"]
    for b, p in zip(baseline, passes):
        before, after = b.summary["peak_memory_bytes_after"], p.summary["peak_memory_bytes_after"]
        budget = (p.summary.get("budget") or {}).get("memory_budget_bytes")
        rise = ("unchanged" if after == before else
                f"+{format_bytes(after - before)}" if after > before else f"-{format_bytes(before - after)}")
        of = f" of a {format_bytes(budget)} budget" if budget is not None and after != before else ""
        lines.append(f"  {p.summary['graph']}: {format_bytes(before)} -> {format_bytes(after)} ({rise}{of})")
    return lines


def _headline(baseline: list, passes: list) -> str:
    """The step (all graphs) without any pass -> with the passes: the demo's comparable headline."""
    before = totals([d.summary for d in baseline])
    after = totals([d.summary for d in passes])
    step = {"graph": f"step without any pass ({len(baseline)} graphs) -> with the passes ({len(passes)} graphs)"}
    for key in ("n_collectives", "exposed_comm_ms", "makespan_ms", "peak_memory_bytes"):
        step[f"{key}_before"] = before[f"{key}_after"]
        step[f"{key}_after"] = after[f"{key}_after"]
    step["lower_bound_ms"] = after["lower_bound_ms"]
    return summary_table(step).rstrip("\n")
