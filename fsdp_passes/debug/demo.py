"""``python -m fsdp_passes demo``: the passes on a built-in Llama-style model, no GPU or cluster needed.

The model is sharded SimpleFSDP-style (``fsdp_passes.testing``) over a fake process group of
``world_size`` ranks, compiled forward and backward with the passes on and ``debug_dir`` set, and the
dumps are summarised.  By default the compile stops right after Inductor's scheduler passes (the
capture helper of ``fsdp_passes.testing``): everything the passes do has happened by then, and no C++
kernels need building.  ``full_compile=True`` runs a real ``torch.compile`` step instead (minutes on CPU).

When a pass falls back (it failed, or its planner is not installed) the demo still writes a dump of the
unchanged schedule for that graph, marked with the reason, so the numbers of the baseline are visible.

The same step is first compiled with the passes doing nothing (``bucketing="none"``, ``reorder=False``;
dumps in ``<out>/baseline``): the headline compares every mode against that step, so the numbers of
auto, manual and none are comparable with each other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from ..report import GraphReport, fill_schedule_numbers, last_reports

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


BASELINE_DIR = "baseline"  # sub-folder of the dump folder: the same step compiled without any pass


@dataclass
class DemoResult:
    out: str
    baseline: str | None = None  # dumps of the step without any pass (bucketing="none", reorder=False)
    graphs: list[str] = field(default_factory=list)
    fallbacks: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def _kind_of(name: str) -> str:
    return "bwd" if "_bwd" in name else "fwd"


class _DemoSchedulerPass:
    """Wraps the installed scheduler pass: progress lines, and a baseline dump when the pass falls back."""

    def __init__(self, inner: Any, options: Any, say: Callable[[str], None], caught: list, result: DemoResult):
        self.inner, self.options, self.say, self.caught, self.result = inner, options, say, caught, result
        self.seq = 0

    def __call__(self, nodes: list) -> list:
        from torch._inductor.virtualized import V

        kind = "bwd" if getattr(V.graph, "is_backward", False) else "fwd"
        n_before = sum(1 for r in last_reports() if r.pass_name == "scheduler")
        n_warnings = len(self.caught)
        fx_name = self._pending_fx_name(kind)
        out = self.inner(nodes)
        reports = [r for r in last_reports() if r.pass_name == "scheduler"]
        if len(reports) > n_before and reports[-1].fallback:  # the pass dumped the unchanged schedule itself
            name = reports[-1].graph
            self.result.fallbacks[name] = reports[-1].fallback
            self.say(f"  {'backward' if kind == 'bwd' else 'forward'} graph {name}: {len(nodes)} scheduler nodes; "
                     f"reordering fell back, the unchanged schedule is dumped ({reports[-1].fallback})")
        elif len(reports) > n_before:
            name = reports[-1].graph
            self.say(f"  {'backward' if kind == 'bwd' else 'forward'} graph {name}: {len(nodes)} scheduler nodes, "
                     f"{reports[-1].collectives_moved} collectives moved")
        else:
            name = fx_name or self._new_name(kind)
            why = next((str(w.message) for w in reversed(self.caught[n_warnings:])
                        if "scheduler pass" in str(w.message)), "the scheduler pass did not run")
            self.result.fallbacks[name] = why
            self.say(f"  {'backward' if kind == 'bwd' else 'forward'} graph {name}: {len(nodes)} scheduler nodes; "
                     f"reordering fell back, dumping the unchanged schedule ({why})")
            self._baseline_dump(name, nodes, why)
        self.result.graphs.append(name)
        if kind == "fwd":
            self.say("compiling backward ...")
        return out

    def _new_name(self, kind: str) -> str:
        try:  # the passes' own naming (compile order, frame id), so folders sort the same way
            from ..inductor.hooks import _new_graph_name

            return _new_graph_name(kind)
        except Exception:
            self.seq += 1
            return f"{900 + self.seq:03d}_{kind}"

    def _pending_fx_name(self, kind: str) -> str | None:
        seen = {r.graph for r in last_reports() if r.pass_name == "scheduler"} | set(self.result.graphs)
        for r in reversed(last_reports()):
            if r.pass_name == "fx" and _kind_of(r.graph) == kind and r.graph not in seen:
                return r.graph
        return None

    def _baseline_dump(self, name: str, nodes: list, why: str) -> None:
        from ..cost_model import CostModel
        from ..inductor.scheduler_adapter import dag_from_scheduler_nodes
        from ..options import Options
        from . import write_scheduler_dump

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
    baseline_dir = os.path.join(out, BASELINE_DIR)
    _clear_old_dumps(baseline_dir)
    removed = _clear_old_dumps(out)
    if removed:
        say(f"removed {removed} graph dump(s) of an earlier run from {out}")
    say("importing torch ...")
    import torch
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    import fsdp_passes
    from ..inductor.hooks import FsdpSchedulerPass
    from ..testing import build_llama, capture_scheduler_nodes, example_inputs, fake_process_group

    result = DemoResult(out=out)
    kw = cfg.model_kwargs()
    with _quiet_torch(), warnings.catch_warnings(record=True) as caught, fake_process_group(cfg.world_size):
        warnings.simplefilter("always")
        say(f"building a Llama-style model: {cfg.layers} layers, dim {cfg.dim}, {kw['n_heads']} heads, "
            f"ffn {kw['ffn_dim']}, vocab {kw['vocab']}, sequence {cfg.seq_len}, batch {cfg.batch}")
        say(f"sharding it with simple_fsdp(reshard_after_forward=True) over a fake {cfg.world_size}-rank "
            "process group")
        model = build_llama(**kw, reshard_after_forward=True)
        inputs = example_inputs(model, batch=cfg.batch, seed=0)
        n_params = sum(p.numel() for p in model.parameters()) * cfg.world_size
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
            passes = [
                _DemoSchedulerPass(p, opts.to_json(), say, caught, result) if isinstance(p, FsdpSchedulerPass) else p
                for p in inductor_config.reorder_for_compute_comm_overlap_passes
            ]
            with inductor_config.patch(reorder_for_compute_comm_overlap_passes=passes):
                if cfg.full_compile:
                    say("compiling forward with torch.compile (full Inductor compile, C++ kernels) ...")
                    with inductor_config.patch(fx_graph_cache=False), \
                            functorch_config.patch(enable_autograd_cache=False):
                        compiled = torch.compile(model, fullgraph=True)
                        loss = compiled(*inputs).float().sum()
                        loss.backward()
                else:
                    say("compiling forward (Dynamo, AOTAutograd, Inductor lowering and scheduling; "
                        "stops after the scheduler passes, no kernels are built) ...")
                    capture_scheduler_nodes(model, *inputs)
        torch._dynamo.reset()
    fx_falls = [r for r in last_reports() if r.pass_name == "fx" and r.fallback]
    for w in caught:
        msg = str(w.message)
        if msg.startswith("fsdp_passes fx pass failed") and fx_falls:
            say(f"note: bucketing fell back: {msg.split(': ', 1)[-1]}")
            break
    result.seconds = time.perf_counter() - start
    return result
