"""Profile-guided calibration: a real compiled step (2 gloo ranks) profiled with torch.profiler, calibrated
from its Chrome trace, and the scheduler pass pricing the same graphs with the measured times."""

from __future__ import annotations

import glob
import json
import os
import statistics
from collections import defaultdict

import pytest

import fsdp_passes
from fsdp_passes.cost_model import Calibration
from fsdp_passes.cost_model.trace_calibration import kernel_stem

LAYERS, DIM = 2, 64


def _profiled_step(rank: int, world_size: int, trace_path: str, cache_dir: str) -> bool:
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    from fsdp_passes.testing.models import build_mlp, example_inputs

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    inductor_config.cpp.enable_kernel_profile = True  # Inductor's C++ kernels appear in the trace by name
    fsdp_passes.enable(bucketing="none", reorder=False, cluster="cpu-gloo")
    model = build_mlp(LAYERS, DIM)
    x = example_inputs(model)
    step = torch.compile(model)
    for _ in range(2):
        step(*x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            step(*x).sum().backward()
    if rank == 0:
        prof.export_chrome_trace(trace_path)
    return True


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    from fsdp_passes.testing import run_on_gloo

    path = str(tmp_path_factory.mktemp("trace") / "step.json")
    cache = os.environ.get("FSDP_PASSES_TEST_CACHE") or str(tmp_path_factory.mktemp("inductor"))
    run_on_gloo(2, _profiled_step, path, cache, timeout=600)
    with open(path) as fh:
        return path, [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]


def test_calibration_reproduces_the_measured_kernels_and_collectives(trace):
    path, events = trace
    cal = fsdp_passes.calibrate_from_trace(path)
    # generated kernels: every C++ kernel of the step, at the median of its runs in the trace
    runs = defaultdict(list)
    for e in events:
        if e["name"].startswith("graph_") and "_cpp_fused_" in e["name"]:
            runs[e["name"].split("_cpp_", 1)[1].rsplit("_", 1)[0]].append(e["dur"] / 1e3)
    assert {"fused_relu", "fused_add", "fused_threshold_backward"} <= set(runs)
    for stem, values in runs.items():
        assert cal.kernel_ms(stem) == pytest.approx(statistics.median(values))
    # collectives: gloo's own events, sized by their recorded input (an all-gather's input is one shard; a
    # reduce-scatter runs as gloo:all_reduce of the full input), averaged per size
    measured = defaultdict(list)
    for e in events:
        if e["name"] in ("gloo:all_gather", "gloo:all_reduce"):
            numel = 1
            for d in e["args"]["Input Dims"][0]:
                numel *= d
            op, nbytes = (("all_gather", 2 * 4 * numel) if e["name"] == "gloo:all_gather"
                          else ("reduce_scatter", 4 * numel))
            measured[(op, nbytes)].append(e["dur"] / 1e3)
    # the model's parameters: weights 128x64 / 64x128 fp32 (32 KiB), biases 128 (512 B) and 64 (256 B)
    assert set(measured) == {(op, b) for op in ("all_gather", "reduce_scatter") for b in (256, 512, 32768)}
    for (op, nbytes), values in measured.items():
        assert cal.collective_ms(op, nbytes, 2) == pytest.approx(sum(values) / len(values))


def test_scheduler_pass_prices_the_graphs_with_the_measured_times(trace, tmp_path, fake_pg_factory, fresh_inductor):
    from fsdp_passes.testing import capture_scheduler_nodes
    from fsdp_passes.testing.models import build_mlp, example_inputs

    path, events = trace
    cal = fsdp_passes.calibrate_from_trace(path)
    cal_path = tmp_path / "calibration.json"
    cal.save(cal_path)
    assert Calibration.load(cal_path) == cal
    fake_pg_factory(2, 0)  # same group size as the profiled run, no data moves
    model = build_mlp(LAYERS, DIM)
    debug = tmp_path / "dump"
    capture_scheduler_nodes(model, *example_inputs(model), options=dict(
        bucketing="none", reorder=True, cluster="cpu-gloo", calibration=str(cal_path), debug_dir=str(debug),
        check_ranks=False))  # its host call is no kernel: the graphs hold only what the profiled run timed
    trace_ms = defaultdict(list)  # straight from the trace: generated kernels by name stem
    for e in events:
        stem = kernel_stem(e["name"])
        if stem:
            trace_ms[stem].append(e["dur"] / 1e3)
    dumps = sorted(glob.glob(str(debug / "*" / "dag.json")))
    assert len(dumps) == 2  # forward and backward
    matched_kernels = matched_colls = 0
    for dump in dumps:
        with open(dump) as fh:
            data = json.load(fh)
        for node, ms in zip(data["nodes"], data["durations_ms"]):
            if node["kind"] == "compute":
                # every compute node of these graphs was measured: a generated kernel or an aten extern
                assert node["kernel_key"] is not None and cal.kernel_ms(node["kernel_key"]) == ms, node
                if node["kernel_key"] in trace_ms:
                    assert ms == pytest.approx(statistics.median(trace_ms[node["kernel_key"]]))
                    matched_kernels += 1
            elif node["kind"] == "collective":
                assert ms == cal.collective_ms(node["collective"], node["comm_bytes"], 2), node
                matched_colls += 1
    assert matched_kernels >= 4 and matched_colls >= 10


def test_trace_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        fsdp_passes.calibrate_from_trace(bad)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::add", "ts": 0, "dur": 1}]}))
    with pytest.raises(ValueError, match="enable_kernel_profile"):
        fsdp_passes.calibrate_from_trace(empty)
    with pytest.raises(ValueError, match="missing.json"):
        fsdp_passes.calibrate_from_trace(tmp_path / "missing.json")


def test_kernel_stem_of_cpu_and_cuda_kernel_names():
    assert kernel_stem("graph_0_cpp_fused_relu_sum_3") == "fused_relu_sum"
    assert kernel_stem("cpp_fused_add_1") == "fused_add"
    assert kernel_stem("triton_poi_fused_relu_0") == "fused_relu"
    assert kernel_stem("triton_red_fused_native_layer_norm_12") == "fused_native_layer_norm"
    assert kernel_stem("ncclDevKernel_AllGather_RING_LL") is None
    assert kernel_stem("aten::mm") is None


def test_calibrate_command_reads_a_trace(trace, tmp_path):
    from fsdp_passes.__main__ import main

    path, _ = trace
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--trace", path, "--out", str(out)]) == 0
    assert Calibration.load(out) == fsdp_passes.calibrate_from_trace(path)
    missing = tmp_path / "nope.json"
    assert main(["calibrate", "--trace", str(missing), "--out", str(out)]) == 2


def test_cuda_trace_format_device_kernels_and_nccl_arguments(tmp_path):
    """The CUDA form of the same file: device kernels (``cat: kernel``) are timed instead of host ops, NCCL
    kernels carry their collective's name, element counts, dtype and group size as arguments, and a library
    kernel (cuBLAS) is linked by its ``External id`` to the aten op of the compiled graph that launched it.  (A synthetic
    trace in torch.profiler's CUDA layout: no GPU on the machines that run this suite.)"""
    def kernel(name, ts, dur, **args):
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
                "args": {"device": 0, "stream": 7, **args}}

    nccl = dict(**{"Collective name": "_allgather_base", "In msg nelems": 1024, "Out msg nelems": 8192,
                   "Group size": 8, "dtype": "BFloat16"})
    rs = dict(**{"Collective name": "reduce_scatter_tensor_coalesced", "In msg nelems": 8192,
                 "Out msg nelems": 1024, "Group size": 8, "dtype": "Float"})
    def cpu_op(name, ts, dur, ext, **args):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 4321, "tid": 1, "ts": ts, "dur": dur,
                "args": {"External id": ext, **args}}

    mm_shapes = {"Input Dims": [[8, 8], [8, 8]], "Input type": ["float", "float"]}
    events = [
        # (host ops carry the process's pid, device kernels the device's, as torch.profiler writes them)
        # the compiled graph's wrapper calls aten::mm twice (an extern kernel: its host time is ignored, its
        # device kernels are summed per call); the second call's split-K reduction is launched from inside a
        # nested op; an aten::mm outside any compiled graph (eager code) is not an extern kernel of the graph
        cpu_op("## Call CompiledFxGraph fxyz ##", 0, 90, 1),
        cpu_op("aten::mm", 10, 20, 2, **mm_shapes),
        cpu_op("aten::mm", 40, 30, 3, **mm_shapes),
        cpu_op("aten::sum", 50, 10, 4),
        cpu_op("aten::mm", 95, 5, 9, **mm_shapes),
        kernel("triton_poi_fused_relu_0", 100, 12.0),
        kernel("triton_poi_fused_relu_3", 300, 14.0),
        kernel("triton_red_fused_native_layer_norm_1", 200, 30.0),
        kernel("sm90_xmma_gemm_f32f32_f32f32", 400, 80.0, **{"External id": 2}),
        kernel("sm90_xmma_gemm_f32f32_f32f32", 420, 60.0, **{"External id": 3}),
        kernel("splitKreduce_kernel", 490, 10.0, **{"External id": 4}),
        kernel("sm90_xmma_gemm_f32f32_f32f32", 800, 500.0, **{"External id": 9}),
        kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 500, 40.0, **nccl),
        kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 600, 44.0, **nccl),
        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 700, 70.0, **rs),
    ]
    path = tmp_path / "cuda.json"
    path.write_text(json.dumps({"traceEvents": events}))
    cal = fsdp_passes.calibrate_from_trace(path)
    assert cal.kernel_keys() == ["aten.mm float32[8,8];float32[8,8]", "fused_native_layer_norm", "fused_relu"]
    assert cal.kernel_ms("aten.mm float32[8,8];float32[8,8]") == pytest.approx(0.075)  # median of 80 and 60+10 us
    assert cal.kernel_ms("fused_relu") == pytest.approx(0.013)  # median of 12 and 14 us
    assert cal.kernel_ms("fused_native_layer_norm") == pytest.approx(0.030)
    # full payloads: 8192 bf16 gathered = 16 KiB; 8192 fp32 before the scatter = 32 KiB
    assert cal.points("all_gather", 8) == [(16384, pytest.approx(0.042))]
    assert cal.points("reduce_scatter", 8) == [(32768, pytest.approx(0.070))]
