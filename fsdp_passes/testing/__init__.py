"""Test harness: fake and gloo process groups, SimpleFSDP-style models, graph and scheduler capture.

>>> from fsdp_passes.testing import fake_process_group, build_mlp, example_inputs, capture_fx_graphs
>>> with fake_process_group(world_size=8):
...     model = build_mlp(n_layers=2, dim=64)
...     graphs = capture_fx_graphs(model, *example_inputs(model))
"""

from .dag_builder import DagBuilder
from .capture import CapturedGraphs, SchedulerCapture, capture_fx_graphs, capture_scheduler_nodes
from .gloo import RankFailed, run_on_gloo, set_gloo_worker_threads
from .inflight import InflightHazard, inflight_hazards
from .models import (
    FSDP_PARAM_META_KEY,
    FSDPParam,
    Llama,
    MLP,
    build_llama,
    build_mlp,
    example_inputs,
    fsdp_param_of,
    fsdp_params,
    simple_fsdp,
)
from .process_group import fake_process_group
from ..inductor.failure_injection import inject_failure

__all__ = [
    "DagBuilder",
    "CapturedGraphs",
    "SchedulerCapture",
    "capture_fx_graphs",
    "capture_scheduler_nodes",
    "RankFailed",
    "run_on_gloo",
    "set_gloo_worker_threads",
    "InflightHazard",
    "inflight_hazards",
    "FSDP_PARAM_META_KEY",
    "FSDPParam",
    "Llama",
    "MLP",
    "build_llama",
    "build_mlp",
    "example_inputs",
    "fsdp_param_of",
    "fsdp_params",
    "simple_fsdp",
    "fake_process_group",
    "inject_failure",
]
