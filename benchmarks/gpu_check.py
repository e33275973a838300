"""``./dev.sh gpu-check``: the whole CUDA path on one GPU in a few minutes, written to one results JSON.

1. **Plan** (runs on CPU too; ``tests/benchmarks/test_gpu_check.py`` runs it there): the demo's Llama-style model
   (``fsdp_passes.cli.demo.DemoConfig``) sharded by ``data_parallel`` over a fake process group of
   ``--world-size`` ranks, compiled forward and backward with the passes on and ``strict=True`` (a pass that
   cannot handle a node, e.g. a Triton scheduler node, raises instead of falling back), one step run; the
   scheduler pass's per-graph predictions and per-node priced durations are collected from its dumps.
2. **Measure** (CUDA): ``--steps`` steps of that compiled step timed with CUDA events, ``--profiled`` steps under
   ``torch.profiler``; the trace is calibrated with ``python -m fsdp_passes calibrate --trace`` and each compute
   node's priced time is compared with its kernel's measured median (``gpu_compute.compare_nodes``), the step's
   predicted compute with the measured device time of its kernels and the measured step.  The fake group moves
   no data, so collectives take no device time: this measures the compute side of the cost model.  The plan is
   then captured again with the calibration: how many nodes are priced at their measured time.
3. **Numerics** (CUDA): a world-1 NCCL group, the same model twice (same seed), fp32 (TF32 off): ``--numerics-steps``
   SGD steps compiled with the passes (``strict=True``) against eager.  Tolerance: each step's loss within
   ``LOSS_RTOL`` relative, each gradient of the last step within ``GRAD_RTOL`` of its largest eager entry, every
   final parameter within ``PARAM_ATOL`` absolute.

Without CUDA (``torch.cuda.is_available()`` false) it prints that and exits 0, running nothing.  The exit status
is 1 when a stage raised or the numerics were out of tolerance; the JSON says which.

    ./dev.sh gpu-check                         # -> benchmarks/results/gpu_check.json
    ./dev.sh gpu-check --dim 512 --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_compute import _compute_nodes, _quantiles, compare_nodes  # noqa: E402

LOSS_RTOL = 1e-4  # fp32, Triton / cuBLAS against eager cuBLAS: reductions in another order
GRAD_RTOL = 1e-3  # each gradient of the last step: max abs difference over the eager gradient's max abs value
PARAM_ATOL = 1e-4  # after a few SGD steps at lr 1e-2 on weights of magnitude <= ~1
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu_check.json"


def cluster_for_device(name: str) -> str:
    """The cluster profile whose compute terms belong to the device ``name`` (``torch.cuda.get_device_name``)."""
    for marker, profile in (("H200", "h200"), ("H100", "h100-nvlink"), ("A100", "a100")):
        if marker in name:
            return profile
    return "h100-nvlink"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--world-size", type=int, default=8, help="ranks of the fake group the step is planned for")
    p.add_argument("--cluster", default=None, help="cluster profile (default: from the device's name)")
    p.add_argument("--steps", type=int, default=20, help="timed steps, after 2 warm-up steps")
    p.add_argument("--profiled", type=int, default=3, help="steps in the profiled window")
    p.add_argument("--numerics-steps", type=int, default=3)
    p.add_argument("--work", default="/tmp/fsdp_passes_gpu_check", help="dumps, trace and calibration")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    for name in ("layers", "dim", "seq_len", "batch", "world_size", "steps", "profiled", "numerics_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= 1")
    return args


def demo_config(args: argparse.Namespace, cluster: str) -> Any:
    from fsdp_passes.cli.demo import DemoConfig

    cfg = DemoConfig(layers=args.layers, dim=args.dim, world_size=args.world_size, cluster=cluster,
                     seq_len=args.seq_len, batch=args.batch)
    cfg.validate()
    return cfg


def build_model(cfg: Any, device: str) -> tuple[Any, tuple[Any, ...]]:
    """The demo's model (same weights for the same config) sharded over the current default group, and its
    inputs, on ``device``."""
    import fsdp_passes
    from fsdp_passes.testing import build_llama, example_inputs

    model = build_llama(**cfg.model_kwargs(), fsdp=False).to(device)
    model = fsdp_passes.data_parallel(model, reshard_after_forward=True)
    inputs = tuple(t.to(device) for t in example_inputs(model, batch=cfg.batch, seed=0))
    return model, inputs


def loss_of(model: Any, inputs: tuple[Any, ...]) -> Any:
    return model(*inputs).float().square().mean()


@dataclass
class Planned:
    """What the planning half leaves for the measuring half: the compiled step and its predictions."""

    step: Callable[[], Any]
    summary: dict[str, Any] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)


def plan(cfg: Any, device: str, work: Path) -> Planned:
    """Build the model, compile its step with the passes in strict mode (inside a fake process group the caller
    opened) and run it once; the predictions come from the scheduler pass's dumps in ``work / "plan"``."""
    import torch
    import torch._dynamo

    import fsdp_passes
    from fsdp_passes.inductor.install import compile_caches_off

    model, inputs = build_model(cfg, device)
    compiled = torch.compile(lambda *x: loss_of(model, x), fullgraph=True)

    def step() -> Any:
        for p in model.parameters():
            p.grad = None
        loss = compiled(*inputs)
        loss.backward()
        return loss

    torch._dynamo.reset()
    fsdp_passes.last_reports(clear=True)
    t0 = time.perf_counter()
    with fsdp_passes.enabled(strict=True, cluster=cfg.cluster, debug_dir=str(work / "plan")), compile_caches_off():
        loss = step()  # compiles forward and backward
    compile_s = time.perf_counter() - t0
    reports = fsdp_passes.last_reports()
    scheduler = [r for r in reports if r.pass_name == "scheduler"]
    nodes = _compute_nodes(work / "plan")
    summary = {
        "device": device, "cluster": cfg.cluster, "world_size": cfg.world_size, "model": cfg.model_kwargs(),
        "batch": cfg.batch, "compile_s": compile_s, "first_loss": float(loss.detach()),
        "graphs": [r.graph for r in scheduler],
        "fallbacks": {r.graph: r.fallback for r in reports if r.fallback},
        "reports": [r.one_line() for r in reports],
        "collectives_per_graph": {r.graph: r.n_collectives_after for r in scheduler},
        "collectives_moved": sum(r.collectives_moved for r in scheduler),
        "predicted_makespan_ms": sum(r.makespan_ms_after for r in scheduler),
        "predicted_compute_ms": sum(n["ms"] for n in nodes),
        "compute_nodes": len(nodes),
        "compute_nodes_with_kernel_key": sum(1 for n in nodes if n["key"]),
        "pass_s": sum(r.pass_time_s for r in reports),
    }
    return Planned(step=step, summary=summary, nodes=nodes)


def measure(planned: Planned, cfg: Any, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """CUDA only: time and profile the planned step, calibrate from the trace, compare with the predictions."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import fsdp_passes
    from fsdp_passes.cost_model.calibration import Calibration
    from fsdp_passes.testing import capture_scheduler_nodes

    out: dict[str, Any] = {}
    for _ in range(2):
        planned.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        planned.step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    out["measured_step_ms"] = _quantiles(times)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(args.profiled):
            planned.step()
        torch.cuda.synchronize()
    trace = work / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel" and not str(e.get("name", "")).lower().startswith("nccl")]
    out["measured_kernel_ms_per_step"] = sum(e["dur"] for e in kernels) / 1e3 / args.profiled
    out["kernels_per_step"] = len(kernels) / args.profiled

    cal_path = work / "calibration.json"  # through the command line, as a user calibrates
    cli = subprocess.run([sys.executable, "-m", "fsdp_passes", "calibrate", "--trace", str(trace), "--out",
                          str(cal_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    out["calibrate_cli"] = {"returncode": cli.returncode, "output_tail": (cli.stdout + cli.stderr)[-2000:]}
    if cli.returncode != 0:
        raise RuntimeError(f"python -m fsdp_passes calibrate --trace failed:\n{cli.stdout}\n{cli.stderr}")
    cal = Calibration.load(cal_path)
    out["kernels"] = compare_nodes(planned.nodes, cal)
    predicted = planned.summary["predicted_compute_ms"]
    out["predicted_compute_over_measured_kernels"] = _ratio(predicted, out["measured_kernel_ms_per_step"])
    out["predicted_compute_over_measured_step"] = _ratio(predicted, out["measured_step_ms"]["median"])

    # the same plan priced with the calibration (capture only: no code is generated)
    model, inputs = build_model(cfg, "cuda")
    fsdp_passes.last_reports(clear=True)
    capture_scheduler_nodes(lambda *x: loss_of(model, x), *inputs,
                            options=dict(strict=True, cluster=cfg.cluster, calibration=str(cal_path),
                                         debug_dir=str(work / "calibrated")))
    nodes = _compute_nodes(work / "calibrated")
    priced = [n for n in nodes if n["key"] and cal.kernel_ms(n["key"]) == n["ms"]]
    calibrated_ms = sum(n["ms"] for n in nodes)
    out["calibrated"] = {
        "compute_nodes": len(nodes), "priced_at_measured_time": len(priced),
        "predicted_compute_ms": calibrated_ms,
        "predicted_compute_over_measured_kernels": _ratio(calibrated_ms, out["measured_kernel_ms_per_step"]),
        "predicted_makespan_ms": sum(r.makespan_ms_after for r in fsdp_passes.last_reports()
                                     if r.pass_name == "scheduler"),
    }
    return out


def numerics(cfg: Any, device: str, backend: str, steps: int) -> dict[str, Any]:
    """A world-1 ``backend`` group: ``steps`` SGD steps compiled with the passes (strict) against eager, fp32."""
    import torch
    import torch._dynamo
    import torch.distributed as dist

    import fsdp_passes
    from fsdp_passes.inductor.install import compile_caches_off

    init: dict[str, Any] = {"device_id": torch.device("cuda", torch.cuda.current_device())} if device == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **init)
    try:
        losses: dict[str, list[float]] = {}
        grads: dict[str, list[Any]] = {}
        params: dict[str, list[Any]] = {}
        for name in ("eager", "compiled"):
            torch._dynamo.reset()
            model, inputs = build_model(cfg, device)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            fn = (lambda *x: loss_of(model, x)) if name == "eager" else torch.compile(
                lambda *x: loss_of(model, x), fullgraph=True)
            losses[name] = []
            with (fsdp_passes.enabled(strict=True, cluster=cfg.cluster) if name == "compiled" else nullcontext()), \
                    compile_caches_off():
                for _ in range(steps):
                    opt.zero_grad(set_to_none=True)
                    loss = fn(*inputs)
                    loss.backward()
                    grads[name] = [_full(p.grad) for p in model.parameters()]
                    opt.step()
                    losses[name].append(float(loss.detach()))
            params[name] = [_full(p) for p in model.parameters()]
        loss_rel = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(losses["eager"], losses["compiled"]))
        grad_rel = max(float((c - e).abs().max()) / max(float(e.abs().max()), 1e-30)
                       for e, c in zip(grads["eager"], grads["compiled"]))
        param_abs = max(float((a - b).abs().max()) for a, b in zip(params["eager"], params["compiled"]))
        return {"backend": backend, "steps": steps, "losses": losses, "loss_max_rel_diff": loss_rel,
                "grad_max_rel_diff": grad_rel, "param_max_abs_diff": param_abs, "loss_rtol": LOSS_RTOL,
                "grad_rtol": GRAD_RTOL, "param_atol": PARAM_ATOL,
                "within_tolerance": loss_rel <= LOSS_RTOL and grad_rel <= GRAD_RTOL and param_abs <= PARAM_ATOL}
    finally:
        dist.destroy_process_group()


def _ratio(a: float, b: float) -> float | None:
    """a / b, None when nothing was measured (no device kernels in the trace)."""
    return a / b if b else None


def _full(t: Any) -> Any:
    """A (DTensor) parameter or gradient as one plain tensor."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _stage(result: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    """Run one stage; its value (or the error) goes into ``result[name]`` with its wall time."""
    t0 = time.perf_counter()
    try:
        value = fn()
        result[name] = value if isinstance(value, dict) else {"ok": True}
        return value
    except Exception:  # noqa: BLE001 - recorded, and the exit status says a stage failed
        result[name] = {"error": traceback.format_exc()}
        return None
    finally:
        result.setdefault("wall_s", {})[name] = time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        print(f"gpu-check: no CUDA ({why}; torch {torch.__version__}): nothing run")
        return 0
    # fp32 numerics against eager: no TF32 anywhere
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    from fsdp_passes.testing import fake_process_group

    device_name = torch.cuda.get_device_name()
    cluster = args.cluster or cluster_for_device(device_name)
    cfg = demo_config(args, cluster)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"argv": sys.argv[1:] if argv is None else argv, "torch": torch.__version__,
                              "cuda": torch.version.cuda, "python": platform.python_version(),
                              "device": device_name, "cluster": cluster}
    t0 = time.perf_counter()
    with fake_process_group(cfg.world_size):
        planned = _stage(result, "plan", lambda: plan(cfg, "cuda", work))
        if isinstance(planned, Planned):
            result["plan"] = planned.summary
            _stage(result, "measure", lambda: measure(planned, cfg, args, work))
    torch._dynamo.reset()
    world1 = demo_config(argparse.Namespace(**dict(vars(args), world_size=1)), cluster)
    _stage(result, "numerics", lambda: numerics(world1, "cuda", "nccl", args.numerics_steps))
    result["total_s"] = time.perf_counter() - t0
    failed = [name for name in ("plan", "measure", "numerics") if "error" in result.get(name, {})]
    if result.get("plan", {}).get("fallbacks"):
        failed.append("plan (a pass fell back)")
    if "error" not in result.get("numerics", {"error": 1}) and not result["numerics"]["within_tolerance"]:
        failed.append("numerics (out of tolerance)")
    result["failed"] = failed
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    brief = {k: result.get(k) for k in ("device", "cluster", "total_s", "failed")}
    brief.update({k: result.get("measure", {}).get(k) for k in ("predicted_compute_over_measured_kernels",
                                                                 "predicted_compute_over_measured_step")})
    brief["numerics"] = {k: result.get("numerics", {}).get(k) for k in ("loss_max_rel_diff", "grad_max_rel_diff",
                                                                          "param_max_abs_diff")}
    print(json.dumps(brief, indent=1, default=str))
    print(f"gpu-check: results in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
