"""Inductor's own overlap planners, configured as torchtitan's graph_trainer configures them, for the benchmarks
that race fsdp_passes against them (``schedule_quality.py`` on captured graphs, ``emulated_cluster.py`` on a
measured link).

torchtitan (``experiments/graph_trainer/jit_backend.py``, Inductor backend) installs one of two FX passes as
``post_grad_custom_post_pass`` and turns off what would fight it:

- ``auto_bucketing``: ``schedule_overlap_bucketing_from_inductor_configs`` (the OverlapScheduler) with
  ``aten_distributed_optimizations.collective_bucketing`` and ``insert_overlap_deps`` on;
- ``transformer_block_bucketing``: ``manual_overlap_bucketing(module_bucket_plans=..., insert_overlap_deps=True)``,
  one plan entry per transformer block;
- both: ``allow_buffer_reuse``, ``reorder_for_peak_memory`` and ``reorder_for_compute_comm_overlap`` off.

On a CPU the OverlapScheduler's roofline asks triton for the device's peaks and its collective estimator asks
NCCL's model: the peaks are patched to the cluster profile's and collectives are priced by fsdp_passes' cost
model on the same profile (``custom_runtime_estimation``), so the peer plans with the numbers ours plans with.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from typing import Any, Callable, Iterator

import torch
# Registers the bucketing:: ops Inductor's bucketed graphs call: a graph loaded from the FX cache calls them
# without the pass (whose module defines them) having been imported in this process.
import torch._inductor.fx_passes.bucketing  # noqa: F401

OVERLAP_SCHEDULING_NOTE = (
    "torchtitan graph_trainer auto_bucketing, Inductor backend: OverlapScheduler as post_grad_custom_post_pass, "
    "collective_bucketing and insert_overlap_deps on; allow_buffer_reuse, reorder_for_peak_memory, "
    "reorder_for_compute_comm_overlap off; on this CPU: analytical compute at the profile's peaks, no fusion "
    "regions, collectives priced by fsdp_passes' cost model on the same profile")

#: what torchtitan switches off beside either pass (Inductor config keys)
TORCHTITAN_OFF = {"allow_buffer_reuse": False, "reorder_for_peak_memory": False,
                  "reorder_for_compute_comm_overlap": False}


def collective_payload(node: torch.fx.Node) -> tuple[str, int, int, int]:
    """(op, full payload bytes, group size, in+out bytes) of a functional collective FX node."""
    def nbytes(v: Any) -> int:
        if isinstance(v, torch.Tensor):
            return v.numel() * v.element_size()
        if isinstance(v, (list, tuple)):
            return sum(nbytes(x) for x in v)
        return 0

    name = str(node.target)
    out = nbytes(node.meta.get("val"))
    inp = sum(nbytes(a.meta.get("val")) for a in node.args if isinstance(a, torch.fx.Node))
    size = next((a for a in node.args if isinstance(a, int) and not isinstance(a, bool)), None)
    if "all_gather" in name:
        return "all_gather", out, size or 1, inp + out
    if "reduce_scatter" in name:
        return "reduce_scatter", inp, size or 1, inp + out
    if "all_reduce" in name:
        return "all_reduce", inp, torch.distributed.get_world_size(), inp + out
    return "other", 0, 1, inp + out


def overlap_estimator(cost_model: Any) -> Callable[[torch.fx.Node, Any], Any]:
    """``custom_runtime_estimation`` for the OverlapScheduler: collectives priced by ``cost_model`` (ms) on their
    group's ranks (so the peer plans with the numbers ours plans with: a strided dp group of a 2-D mesh crosses
    nodes); compute left to Inductor's own estimate (None)."""
    from fsdp_passes.dag.ops import group_facts

    world = torch.distributed.get_world_size()

    def estimate(node: torch.fx.Node, override_size: Any = None) -> Any:
        if node.op != "call_function" or "_c10d_functional" not in str(node.target):
            return None
        op, payload, size, in_out = collective_payload(node)
        if op == "other":
            return None
        if override_size is not None:  # Inductor's size unit is input + output bytes
            payload = int(override_size * payload / in_out) if in_out else int(override_size)
        group_name = next((a for a in reversed(node.args) if isinstance(a, str)), None)
        group_size, ranks = group_facts(group_name) if group_name is not None else (None, None)
        if group_size is None:
            group_size = world if op == "all_reduce" else size
        return cost_model.collective_ms(op, payload, group_size, ranks)

    return estimate


def _tflops(profile: Any, dtype: Any) -> float:
    return {torch.bfloat16: profile.tflops_bfloat16, torch.float16: profile.tflops_float16}.get(
        dtype, profile.tflops_float32)


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def device_peaks_of(profile: Any) -> Iterator[None]:
    """Inductor's roofline reads the device's FLOP/s and DRAM bandwidth from triton (absent on a CPU): give it
    the cluster profile's."""
    import torch.utils._runtime_estimation as rt

    with patched(rt, "get_device_tflops", lambda dtype: _tflops(profile, dtype)), \
            patched(rt, "get_gpu_dram_gbps", lambda: profile.mem_bw_gbps):
        yield


class OverlapSchedulingPass:
    """torchtitan's ``auto_bucketing`` for the Inductor backend: the OverlapScheduler from Inductor's config.
    ``on_time(seconds)`` is told how long each call took."""

    def __init__(self, on_time: Callable[[float], None] | None = None) -> None:
        self.on_time = on_time

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing_from_inductor_configs

        t = time.perf_counter()
        try:
            schedule_overlap_bucketing_from_inductor_configs(graph.owning_module)
        finally:
            if self.on_time:
                self.on_time(time.perf_counter() - t)

    def uuid(self) -> bytes:
        return hashlib.sha256(b"inductor-overlap-scheduling").digest()


_ROOT = re.compile(r"^[LG]\['[^']+'\]")
_ITEM = re.compile(r"(?:\._modules)?\['([^']+)'\]")


def module_path(dynamo_path: str) -> str:
    """A module's name in the model from Dynamo's ``nn_module_stack`` path, whatever the compiled callable:
    ``L['self'].layers.0`` (the model compiled) and ``G['model'].layers.0`` (a function closing over it) both
    give ``layers.0``.  Inductor's own reader keeps only the first form's names (it is what torchtitan
    compiles); the benchmarks compile a loss function, so the manual pass is given this reader."""
    return _ITEM.sub(lambda m: "." + m.group(1), _ROOT.sub("", dynamo_path)).lstrip(".")


def module_stack(node: torch.fx.Node) -> list[tuple[str, type]]:
    """``module_stack_fn`` for ``manual_overlap_bucketing``: the node's module stack, outermost first, named as
    in the model (``module_path``); backward nodes carry their forward node's stack."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return [(module_path(path), cls) for path, cls in stack.values()]


class ManualOverlapPass:
    """torchtitan's ``transformer_block_bucketing`` for the Inductor backend: ``manual_overlap_bucketing`` with
    a bucket plan of module names."""

    def __init__(self, plan: list, on_time: Callable[[float], None] | None = None) -> None:
        self.plan = plan
        self.on_time = on_time

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing

        t = time.perf_counter()
        try:
            manual_overlap_bucketing(graph.owning_module, module_bucket_plans=self.plan, insert_overlap_deps=True,
                                     module_stack_fn=module_stack)
        finally:
            if self.on_time:
                self.on_time(time.perf_counter() - t)

    def uuid(self) -> bytes:
        return hashlib.sha256(repr(("manual_overlap", self.plan)).encode()).digest()


def llama_block_plan(layers: int) -> list:
    """torchtitan's ``transformer_block_bucketing`` plan for a Llama: the embeddings, each block, the final norm
    with the output projection."""
    return ["tok_embeddings", *[f"layers.{i}" for i in range(layers)], ["norm", "output"]]


def as_custom_graph_pass(p: Any) -> Any:
    """``p`` (a callable on an FX graph with ``uuid()``) as Inductor's CustomGraphPass (the FX graph cache keys
    on its uuid)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pass(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            p(graph)

        def uuid(self) -> Any:
            return p.uuid()

    return _Pass()


def overlap_scheduling_config(cost_model: Any, on_time: Callable[[float], None] | None = None) -> dict[str, Any]:
    """Inductor config patches for torchtitan's ``auto_bucketing`` on this CPU (enter ``device_peaks_of`` too)."""
    return {
        **TORCHTITAN_OFF,
        "post_grad_custom_post_pass": as_custom_graph_pass(OverlapSchedulingPass(on_time)),
        "aten_distributed_optimizations.collective_bucketing": True,
        "aten_distributed_optimizations.insert_overlap_deps": True,
        # CPU settings: no triton for fusion regions or the roofline; collectives priced by our cost model
        "aten_distributed_optimizations.enable_fusion_regions": False,
        "aten_distributed_optimizations.compute_estimator": "analytical",
        "aten_distributed_optimizations.custom_runtime_estimation": overlap_estimator(cost_model),
    }


def manual_overlap_config(plan: list, on_time: Callable[[float], None] | None = None) -> dict[str, Any]:
    """Inductor config patches for torchtitan's ``transformer_block_bucketing`` with bucket plan ``plan``."""
    return {**TORCHTITAN_OFF,
            "post_grad_custom_post_pass": as_custom_graph_pass(ManualOverlapPass(plan, on_time))}
