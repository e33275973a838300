"""``enable()`` leaves no second comm planner on: Inductor's own bucketing / overlap passes are switched off while
the passes are installed, and a graph the user compiles with Inductor's FX bucketing set gets only our buckets."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._inductor.comms as comms
import torch._inductor.config as ic

import fsdp_passes
from fsdp_passes.inductor.passes import FsdpSchedulerPass


@pytest.fixture(autouse=True)
def _clean():
    fsdp_passes.disable()
    yield
    fsdp_passes.disable()


def _user_scheduler_pass(nodes):
    return nodes


# every Inductor knob that buckets or reorders collectives in torch 2.13, as a user could switch it on ...
USER_ON = {
    "bucket_all_gathers_fx": "all",
    "bucket_reduce_scatters_fx": "all",
    "bucket_all_reduces_fx": "all",
    "_fuse_ddp_communication": True,
    "aten_distributed_optimizations.enable_overlap_scheduling": True,
    "aten_distributed_optimizations.collective_bucketing": True,
    "aten_distributed_optimizations.pre_bucketing_fsdp_collectives": True,
}
# ... and as enable() must leave it (written out here, not read from the code under test)
LEFT_BY_ENABLE = {
    "bucket_all_gathers_fx": "none",
    "bucket_reduce_scatters_fx": "none",
    "bucket_all_reduces_fx": "none",
    "_fuse_ddp_communication": False,
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "aten_distributed_optimizations.collective_bucketing": False,
    "aten_distributed_optimizations.pre_bucketing_fsdp_collectives": False,
}


def _read(names):
    return {name: getattr(ic, name) for name in names}


def test_enable_switches_inductor_comm_passes_off_warns_once_and_disable_restores(caplog):
    user_passes = ["sink_waits", comms.raise_comms, _user_scheduler_pass, "reorder_communication_preserving_peak_memory"]
    with ic.patch(dict(USER_ON, reorder_for_compute_comm_overlap=True,
                       reorder_for_compute_comm_overlap_passes=user_passes)):
        before = _read(USER_ON)
        with caplog.at_level(logging.WARNING, logger="fsdp_passes"):
            fsdp_passes.enable(bucketing="auto")
            fsdp_passes.enable(bucketing="none")  # re-install: still off, no second warning
        assert _read(LEFT_BY_ENABLE) == LEFT_BY_ENABLE
        passes = ic.reorder_for_compute_comm_overlap_passes
        # Inductor's reordering passes (by name or as functions) are gone; the user's own pass stays, before ours
        assert passes[0] is _user_scheduler_pass and len(passes) == 2
        assert isinstance(passes[1], FsdpSchedulerPass)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        for name in ("bucket_all_gathers_fx", "bucket_reduce_scatters_fx", "bucket_all_reduces_fx",
                     "_fuse_ddp_communication", "enable_overlap_scheduling", "sink_waits", "raise_comms",
                     "reorder_communication_preserving_peak_memory"):
            assert name in warnings[0], name
        assert "_user_scheduler_pass" not in warnings[0]
        fsdp_passes.disable()
        assert _read(USER_ON) == before == USER_ON
        assert ic.reorder_for_compute_comm_overlap_passes == user_passes


def test_enable_with_inductor_defaults_warns_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="fsdp_passes"):
        fsdp_passes.enable()
    assert _read(LEFT_BY_ENABLE) == LEFT_BY_ENABLE
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    fsdp_passes.disable()
    # torch 2.13's own defaults come back (pre-bucketing is on by default there, inert without the scheduler)
    assert ic.aten_distributed_optimizations.pre_bucketing_fsdp_collectives is True
    assert ic.bucket_all_gathers_fx == "none" and ic.aten_distributed_optimizations.collective_bucketing is None


def _collectives(capture):
    """(op, output numel) of each all-gather / reduce-scatter of the graph Inductor lowered, in graph order."""
    out = []
    for node in capture.graph_lowering.module.graph.nodes:
        name = str(node.target)
        for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            if node.op == "call_function" and op in name:
                out.append((op, node.meta["val"].numel()))
    return out


def test_user_inductor_fx_bucketing_gets_only_our_buckets(fresh_inductor):
    from fsdp_passes.testing import build_mlp, capture_scheduler_nodes, example_inputs, fake_process_group

    ours = dict(bucketing="manual", bucket_plan=["layers.[0-3]"], reorder=False)
    with fake_process_group(world_size=8):
        model = build_mlp(4, 64)
        args = example_inputs(model, batch=4, seed=0)
        inductor_all = {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"}
        with ic.patch(inductor_all):
            inductor_only = [_collectives(c) for c in capture_scheduler_nodes(model, *args)]
        ours_only = [_collectives(c) for c in capture_scheduler_nodes(model, *args, options=ours)]
        with ic.patch(inductor_all):
            both = [_collectives(c) for c in capture_scheduler_nodes(model, *args, options=ours)]
            assert ic.bucket_all_gathers_fx == "all"  # the user's setting is back after the enabled block
    # the comparison means something: Inductor's buckets (everything in one) differ from ours (one per layer)
    # forward: a gather per layer; backward (resharded after forward): a gather and a reduce-scatter per layer
    assert [len(g) for g in ours_only] == [4, 8]
    assert len(inductor_only[0]) < 4 and len(inductor_only[1]) < 8
    assert both == ours_only
