"""``python -m fsdp_passes demo``: the passes on a built-in Llama-style model, no GPU or cluster needed.

The model is sharded SimpleFSDP-style (``fsdp_passes.testing``) over a fake process group of
``world_size`` ranks, compiled forward and backward with the passes on and ``debug_dir`` set, and the
dumps are summarised.  By default the compile stops right after Inductor's scheduler passes (the
capture helper of ``fsdp_passes.testing``): everything the passes do has happened by then, and no C++
kernels need building.  ``full_compile=True`` runs a real ``torch.compile`` step instead (minutes on CPU).

When a pass falls back (it failed, or its planner is not installed) the demo still writes a dump of the
unchanged schedule for that graph, marked with the reason, so the numbers of the baseline are visible.
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
from ..pipeline.report import GraphReport, fill_schedule_numbers
from .common import PROG, say as _say
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
        if self.dim % self.world_size:
            raise ValueError(
                f"--dim {self.dim}: must be divisible by the world size {self.world_size} "
                "(parameters are sharded along dim 0 without padding)"
            )


@dataclass
class DemoResult:
    out: str
    graphs: list[str] = field(default_factory=list)
    fallbacks: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


class _DemoSchedulerPass:
    """Wraps the installed scheduler pass: progress lines, and a baseline dump when the pass falls back."""

    def __init__(self, inner: Any, options: Any, say: Callable[[str], None], result: DemoResult):
        self.inner, self.options, self.say, self.result = inner, options, say, result

    def __call__(self, nodes: list) -> list:
        out = self.inner(nodes)
        report = last_reports()[-1]  # the installed pass reports every graph it sees, also when it falls back
        what = "backward" if "_bwd" in report.graph else "forward"
        if report.fallback is None:
            self.say(f"  {what} graph {report.graph}: {len(nodes)} scheduler nodes, "
                     f"{report.collectives_moved} collectives moved")
        else:
            self.result.fallbacks[report.graph] = report.fallback
            self.say(f"  {what} graph {report.graph}: {len(nodes)} scheduler nodes; "
                     f"reordering fell back, dumping the unchanged schedule ({report.fallback})")
            self._baseline_dump(report.graph, nodes, report.fallback)
        self.result.graphs.append(report.graph)
        if what == "forward":
            self.say("compiling backward ...")
        return out

    def _baseline_dump(self, name: str, nodes: list, why: str) -> None:
        from ..cost_model import CostModel
        from ..debug import write_scheduler_dump
        from ..inductor.scheduler_adapter import dag_from_scheduler_nodes
        from ..options import Options

        opts = Options(**self.options)
        dag = dag_from_scheduler_nodes(nodes)
        durations = CostModel.from_options(opts.cluster, opts.calibration).estimate(dag)
        identity = list(range(len(dag)))
        report = GraphReport(graph=name, pass_name="scheduler", options=opts.to_json(), fallback=why)
        timelines = fill_schedule_numbers(report, (dag, identity, durations), (dag, identity, durations))
        write_scheduler_dump(opts.debug_dir, report, dag, durations, identity, identity, timelines)


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
        last_reports(clear=True)
        torch._dynamo.reset()
        with fsdp_passes.enabled(**options) as opts:
            say(f"passes on: bucketing={opts.bucketing}, reorder={opts.reorder}, cluster={opts.cluster}, "
                f"memory_budget={opts.memory_budget}, debug_dir={opts.debug_dir}")
            with scheduler_pass_wrapped(lambda inner: _DemoSchedulerPass(inner, opts.to_json(), say, result)):
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
    _say("")
    _say(f"dumps: {result.out}/<graph>/ (schedule_before.txt, schedule_after.txt, buckets.json, dag.json, "
         "dag.dot, summary.json)")
    for d in dumps:
        _say(f"trace: {d.file('trace.json')}  (open in https://ui.perfetto.dev)")
    _say(f"again: {PROG} report {result.out}")
    return 0
