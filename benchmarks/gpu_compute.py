"""Predicted vs measured compute of a compiled FSDP step on one GPU.

The built-in Llama (``fsdp_passes.testing.models.Llama``) is sharded by ``data_parallel`` over a fake process
group of ``--world-size`` ranks: every kernel has the shapes of a real job, while the collectives move no data
and take no device time, so one GPU measures the compute side of the cost model.  Parameters are gathered in
bf16 (``MixedPrecisionPolicy``); forward and backward are compiled with the passes on (``--cluster``, default
the ``h200`` profile).  Per model size:

1. Compile with the profile's estimates (``debug_dir`` set), time ``--steps`` steps with CUDA events, profile
   ``--profiled`` steps with ``torch.profiler`` and read the trace with ``calibrate_from_trace``.
2. Per compute node of the scheduler pass's dumps: the duration the passes priced it at (the roofline and
   launch floor of the profile) against the median device time the trace measured for its kernel key
   (generated kernels by name stem, extern kernels by aten op and shapes through the profiler's External id).
3. Compile again with that calibration: how many compute nodes the passes now price at the measured time,
   and the predicted compute of the step against the measured device time of its kernels.

    python benchmarks/gpu_compute.py --out benchmarks/results/gpu_compute_h200.json

Needs a CUDA device (``--device cpu`` runs the same steps on CPU at a toy size, to check the script).
Reports what it measured; nothing here is a pass/fail target.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {  # name -> Llama builder arguments (a 8B-like block shape at "large", launch-bound at "small")
    "large": dict(n_layers=4, dim=2048, n_heads=16, n_kv_heads=8, ffn_dim=5632, vocab=32000, seq_len=2048),
    "medium": dict(n_layers=4, dim=1024, n_heads=8, n_kv_heads=4, ffn_dim=2816, vocab=16384, seq_len=1024),
    "small": dict(n_layers=4, dim=512, n_heads=8, n_kv_heads=4, ffn_dim=1408, vocab=8192, seq_len=512),
    "toy": dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab=256, seq_len=32),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="large,small", help=f"comma-separated, of {sorted(SIZES)}")
    p.add_argument("--calibrated", default="large", help="the size compiled again with its calibration")
    p.add_argument("--no-gqa", action="store_true", help="as many key/value heads as query heads")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--cluster", default="h200")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=20, help="timed steps (CUDA events), after 3 warm-up steps")
    p.add_argument("--profiled", type=int, default=3, help="steps in the profiled window")
    p.add_argument("--work", default="/tmp/gpu_compute", help="dumps and traces")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_compute.json"))
    args = p.parse_args(argv)
    for s in args.sizes.split(","):
        if s not in SIZES:
            p.error(f"--sizes: {s!r} is not one of {sorted(SIZES)}")
    return args


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"n": len(v), "median": statistics.median(v), "p10": pick(0.1), "p90": pick(0.9),
            "min": v[0], "max": v[-1]}


def _compute_nodes(debug_dir: Path) -> list[dict[str, Any]]:
    """Every compute node of the scheduler pass's dumps: graph, kernel key, priced duration (ms)."""
    out = []
    for dump in sorted(debug_dir.rglob("dag.json")):  # only the scheduler pass writes dag.json
        data = json.loads(dump.read_text())
        for node, ms in zip(data["nodes"], data["durations_ms"]):
            if node["kind"] == "compute" and node.get("launches_kernel", True):
                out.append({"graph": dump.parent.name, "key": node.get("kernel_key"), "ms": ms,
                            "flops": node.get("flops"), "bytes": node["in_bytes"] + node["out_bytes"]})
    return out


def compare_nodes(nodes: list[dict[str, Any]], cal: Any) -> dict[str, Any]:
    """Each compute node's priced duration (``_compute_nodes``) against the measured time of its kernel key in
    the calibration ``cal`` (``Calibration.kernel_ms``): counts, predicted / measured quantiles per kernel class
    (aten externs, generated kernels), the matched totals and the twelve largest differences."""
    by_class: dict[str, list[float]] = {"generated": [], "extern": []}
    rows = []
    for n in nodes:
        measured = cal.kernel_ms(n["key"]) if n["key"] else None
        rows.append(dict(n, measured_ms=measured))
        if measured:
            by_class["extern" if n["key"].startswith("aten.") else "generated"].append(n["ms"] / measured)
    matched = [r for r in rows if r["measured_ms"] is not None]
    return {
        "compute_nodes": len(rows),
        "compute_nodes_measured": len(matched),
        "unmatched_keys": sorted({str(r["key"]) for r in rows if r["measured_ms"] is None})[:40],
        "predicted_over_measured": {k: _quantiles(v) for k, v in by_class.items()},
        "matched_predicted_ms": sum(r["ms"] for r in matched),
        "matched_measured_ms": sum(r["measured_ms"] for r in matched),
        "predicted_compute_ms": sum(r["ms"] for r in rows),
        "worst": sorted(matched, key=lambda r: -abs(r["ms"] - r["measured_ms"]))[:12],
    }


def run_size(args: argparse.Namespace, size: str, calibrated_recompile: bool) -> dict[str, Any]:
    import torch
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    import fsdp_passes
    from fsdp_passes import MixedPrecisionPolicy, data_parallel
    from fsdp_passes.cost_model import calibrate_from_trace
    from fsdp_passes.testing.models import Llama

    dev = torch.device(args.device)
    work = Path(args.work) / size
    kw = dict(SIZES[size], n_kv_heads=SIZES[size]["n_heads"]) if args.no_gqa else SIZES[size]
    torch.manual_seed(0)
    model = Llama(**kw).to(dev)
    data_parallel(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    tokens = torch.randint(0, kw["vocab"], (args.batch, kw["seq_len"]), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def make_step(name: str) -> Any:
        def loss_fn(t: torch.Tensor) -> torch.Tensor:
            return model(t).float().square().mean()

        loss_fn.__code__ = loss_fn.__code__.replace(co_name=f"loss_{size}_{name}")  # one Dynamo cache each
        fn = torch.compile(loss_fn)

        def step() -> None:
            for p in model.parameters():
                p.grad = None
            fn(tokens).backward()

        return step

    result: dict[str, Any] = {"size": size, "model": dict(kw, batch=args.batch, world_size=args.world_size)}
    fsdp_passes.last_reports(clear=True)
    t0 = time.perf_counter()
    if dev.type == "cpu":
        inductor_config.cpp.enable_kernel_profile = True
    with fsdp_passes.enabled(cluster=args.cluster, debug_dir=str(work / "dump_profile")):
        step = make_step("profile")
        step()
        sync()
        result["compile_s"] = time.perf_counter() - t0
        for _ in range(2):
            step()
        sync()
        times = []
        for _ in range(args.steps):
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                sync()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                step()
                times.append((time.perf_counter() - t) * 1e3)
        result["measured_step_ms"] = _quantiles(times)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(args.profiled):
                step()
            sync()
    inductor_config.cpp.enable_kernel_profile = False
    trace = work / "trace.json"
    prof.export_chrome_trace(str(trace))
    every = fsdp_passes.last_reports()
    # the passes' share of the first step's compile (Dynamo, AOTAutograd, Inductor, Triton code generation)
    result["pass_s"] = sum(r.pass_time_s for r in every)
    result["pass_share_of_compile"] = result["pass_s"] / result["compile_s"]
    reports = [r for r in every if r.pass_name == "scheduler"]
    result["reports"] = [r.one_line() for r in reports]
    result["predicted_makespan_ms"] = sum(r.makespan_ms_after for r in reports)

    # the device time of the profiled steps' kernels, collectives aside
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel" and not str(e.get("name", "")).lower().startswith("nccl")]
    result["measured_kernel_ms_per_step"] = sum(e["dur"] for e in kernels) / 1e3 / args.profiled
    result["kernels_per_step"] = len(kernels) / args.profiled

    cal = calibrate_from_trace(trace)
    cal_path = work / "calibration.json"
    cal.save(cal_path)
    result.update(compare_nodes(_compute_nodes(work / "dump_profile"), cal))

    if calibrated_recompile:
        torch._dynamo.reset()
        fsdp_passes.last_reports(clear=True)
        with fsdp_passes.enabled(cluster=args.cluster, calibration=str(cal_path),
                                 debug_dir=str(work / "dump_calibrated")):
            make_step("calibrated")()
            sync()
        cal_nodes = _compute_nodes(work / "dump_calibrated")
        priced = [n for n in cal_nodes if n["key"] and cal.kernel_ms(n["key"]) == n["ms"]]
        reports = [r for r in fsdp_passes.last_reports() if r.pass_name == "scheduler"]
        result["calibrated"] = {
            "compute_nodes": len(cal_nodes), "priced_at_measured_time": len(priced),
            "predicted_compute_ms": sum(n["ms"] for n in cal_nodes),
            "predicted_makespan_ms": sum(r.makespan_ms_after for r in reports),
            "reports": [r.one_line() for r in reports],
        }
    return result


def _older_torch_shims() -> None:
    """Lets the passes load on an older torch (2.11) than the one they are built for (2.13), for this script
    only: 2.11's ``reorder_for_compute_comm_overlap_passes`` takes plain callables, so the scheduler pass needs
    no ``CustomSchedulerPass`` base, and it has no control-dependency wrapper op to see through."""
    import types

    import torch._inductor.custom_graph_pass as custom_graph_pass

    if not hasattr(custom_graph_pass, "CustomSchedulerPass"):
        custom_graph_pass.CustomSchedulerPass = type("CustomSchedulerPass", (), {})
    try:
        import torch._inductor.fx_passes.control_dependencies  # noqa: F401
    except ImportError:
        module = types.ModuleType("torch._inductor.fx_passes.control_dependencies")
        module.control_deps = object()  # matches no node's target
        sys.modules[module.__name__] = module


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    _older_torch_shims()

    from fsdp_passes.testing import fake_process_group

    out: dict[str, Any] = {"argv": sys.argv[1:], "torch": torch.__version__, "python": platform.python_version(),
                           "device": (torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()),
                           "cluster": args.cluster, "sizes": {}}
    with fake_process_group(args.world_size):
        for size in args.sizes.split(","):
            t0 = time.perf_counter()
            try:
                out["sizes"][size] = run_size(args, size, calibrated_recompile=(size == args.calibrated))
            except Exception:
                out["sizes"][size] = {"error": traceback.format_exc()}
            out["sizes"][size]["wall_s"] = time.perf_counter() - t0
            print(json.dumps({size: {k: v for k, v in out["sizes"][size].items() if k not in ("worst",)}},
                             indent=1, default=str), flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # written after each size
            Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
