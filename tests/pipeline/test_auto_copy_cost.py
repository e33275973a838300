"""What bucketing adds to the compute stream in auto's score is what Inductor adds: the copy kernels the chosen
plan's merges cost in the score equal the compute the scheduler-level graph of that plan has over the same
model compiled without merging, priced by the same cost model.

The parameters are gathered in bf16: each gather bucket adds one copy-in and one copy-out kernel.  The gradients
are reduced in fp32 from bf16 parameters, so each reduction's input is a cast: Inductor computes the cast
straight into the merged input (no copy kernel), except where the cast reads a reduction (a bias gradient),
whose kernel then runs apart from it.
"""

from __future__ import annotations

import pytest
import torch

import fsdp_passes
from fsdp_passes.cost_model import CostModel
from fsdp_passes.dag.graph import NodeKind

# latency-bound: merging wins, so auto picks a merged plan for the backward
SLOW_LINK = {"base": "cpu-gloo", "intra_node_bw_gbps": 0.05, "inter_node_bw_per_nic_gbps": 0.05}


def _compute_ms(capture, cost_model) -> float:
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes

    with capture.graph_context():
        dag = dag_from_scheduler_nodes(capture.after)
    durations = cost_model.estimate(dag)
    return sum(durations[i] for i, n in enumerate(dag.nodes) if n.kind is NodeKind.COMPUTE)


def test_score_copy_cost_equals_the_compiled_graphs():
    from fsdp_passes.testing import build_mlp, capture_scheduler_nodes, example_inputs, fake_process_group

    options = dict(reorder=False, memory_budget="1GB", cluster=SLOW_LINK)
    with fake_process_group(world_size=8):
        model = build_mlp(1, 64, reshard_after_forward=True, param_dtype=torch.bfloat16,
                          reduce_dtype=torch.float32)
        args = example_inputs(model, batch=8, seed=0)
        unmerged = capture_scheduler_nodes(model, *args, options=dict(options, bucketing="none"))
        fsdp_passes.last_reports(clear=True)
        merged = capture_scheduler_nodes(model, *args, options=dict(options, bucketing="auto"))
        reports = [r for r in fsdp_passes.last_reports(clear=True) if r.pass_name == "fx"]
    cost_model = CostModel.from_options(SLOW_LINK)
    assert [c.graph_name for c in merged] == [c.graph_name for c in unmerged] == ["forward", "backward"]
    assert len(reports) == 2
    for capture_merged, capture_unmerged, report in zip(merged, unmerged, reports):
        choice = report.extra["bucketing"]["auto_choice"]
        chosen = next(c for c in choice["candidates"] if c["name"] == choice["chosen"])
        assert chosen["n_merged_buckets"] > 0, (capture_merged.graph_name, choice)
        added = _compute_ms(capture_merged, cost_model) - _compute_ms(capture_unmerged, cost_model)
        assert added > 0
        assert chosen["copy_ms"] == pytest.approx(added, rel=0.01), capture_merged.graph_name
