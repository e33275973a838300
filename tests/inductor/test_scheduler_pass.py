"""The reordering pass on real Inductor scheduler nodes: prefetch, wait sinking, per-group order, memory
budget, max_prefetch, calibration, and the generated code following the pass's order."""

import json
import re

import pytest
import torch
import torch._dynamo
import torch._inductor.config as ic

import fsdp_passes
from fsdp_passes import Options
from fsdp_passes.dag import NodeKind
from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
from fsdp_passes.testing import build_mlp, capture_scheduler_nodes, example_inputs


@pytest.fixture(scope="module")
def mlp_forward_nodes():
    """Scheduler nodes of a 4-block SimpleFSDP MLP forward (no bucketing), captured once."""
    from fsdp_passes.testing import fake_process_group

    with fake_process_group(world_size=8), ic.patch(fx_graph_cache=False):
        model = build_mlp(n_layers=4, dim=256, reshard_after_forward=True)
        inputs = example_inputs(model, batch=64)
        caps = capture_scheduler_nodes(model, *inputs, backward=True)
        # one bucket per block (weights and biases together), reordering left to the tests
        per_block = capture_scheduler_nodes(
            model, *inputs, backward=True,
            options={"bucketing": "manual", "bucket_plan": ["layers.[0-3]"], "reorder": False, "memory_budget": "1GB"},
        )
        yield {**{c.graph_name: c for c in caps}, **{"bucketed_" + c.graph_name: c for c in per_block}}
    torch._dynamo.reset()


def _dag(cap, nodes=None):
    with cap.graph_context():
        return dag_from_scheduler_nodes(cap.before if nodes is None else nodes)


def _positions(order):
    return {id(n): p for p, n in enumerate(order)}


def _block_of(snode):
    """Which MLP block an all-gather / matmul belongs to, from the FX origins' module path."""
    for origin in sorted(getattr(snode.node, "origins", ()) or (), key=lambda n: n.name):
        stack = origin.meta.get("nn_module_stack") or origin.meta.get("fwd_nn_module_stack") or {}
        for path, _ in reversed(list(stack.values())):
            m = re.search(r"layers[.\[]'?(\d+)", path)
            if m:
                return int(m.group(1))
    return None


def test_forward_prefetches_next_block_all_gather(mlp_forward_nodes):
    cap = mlp_forward_nodes["bucketed_forward"]
    new, report = fsdp_passes.reorder_scheduler_nodes(cap, Options(bucketing="none", memory_budget="100%"))
    dag = _dag(cap)
    pos = _positions(new)
    first_mm = {}
    for i, node in enumerate(dag):
        if node.kind is NodeKind.COMPUTE and node.flops > 0:
            block = _block_of(node.origin)
            if block is not None and (block not in first_mm or pos[id(node.origin)] < first_mm[block]):
                first_mm[block] = pos[id(node.origin)]
    checked = 0
    for c in dag.collectives():
        block = _block_of(dag[c].origin)
        if block is None or block == 0 or (block - 1) not in first_mm:
            continue
        assert len([d for d in dag.collectives() if _block_of(dag[d].origin) == block]) == 1
        # the all-gather of block i+1 is issued before block i's first matmul ...
        assert pos[id(dag[c].origin)] < first_mm[block - 1], (dag[c].name, block)
        # ... and its wait comes after that matmul
        (w,) = dag.waits_of(c)
        assert pos[id(dag[w].origin)] > first_mm[block - 1], (dag[w].name, block)
        checked += 1
    assert checked >= 3
    assert report.exposed_comm_ms_after < report.exposed_comm_ms_before
    assert report.collectives_moved > 0


@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_group_order_and_exposed_comm(mlp_forward_nodes, graph):
    cap = mlp_forward_nodes[graph]
    nodes = cap.before
    new, report = fsdp_passes.reorder_scheduler_nodes(cap, Options(bucketing="none"))
    dag = _dag(cap)
    index = {id(n): i for i, n in enumerate(nodes)}
    order = [index[id(n)] for n in new]
    assert sorted(order) == list(range(len(nodes)))
    assert dag.order_violations(order) == []
    seq_before = [i for i in range(len(nodes)) if dag[i].kind is NodeKind.COLLECTIVE]
    seq_after = [i for i in order if dag[i].kind is NodeKind.COLLECTIVE]
    assert seq_before == seq_after  # one group: the collective sequence is exactly the original one
    assert report.exposed_comm_ms_after <= report.exposed_comm_ms_before
    assert report.makespan_ms_after <= report.makespan_ms_before + 1e-9


def test_zero_memory_budget_never_raises_the_peak(mlp_forward_nodes):
    for graph in ("forward", "backward"):
        _, report = fsdp_passes.reorder_scheduler_nodes(mlp_forward_nodes[graph], Options(memory_budget=0))
        assert report.peak_memory_bytes_after <= report.peak_memory_bytes_before


def test_max_prefetch_bounds_collectives_in_flight(mlp_forward_nodes):
    cap = mlp_forward_nodes["forward"]
    new, _ = fsdp_passes.reorder_scheduler_nodes(cap, Options(memory_budget="100%", max_prefetch=1))
    unbounded, _ = fsdp_passes.reorder_scheduler_nodes(cap, Options(memory_budget="100%"))

    def max_in_flight(order):
        dag = _dag(cap, order)
        in_flight = peak = 0
        for node in dag:
            in_flight += node.kind is NodeKind.COLLECTIVE
            in_flight -= node.kind is NodeKind.WAIT
            peak = max(peak, in_flight)
        return peak

    assert max_in_flight(new) <= 1 < max_in_flight(unbounded)


def test_calibration_and_cluster_change_the_estimates(mlp_forward_nodes, tmp_path):
    from fsdp_passes.cost_model import Calibration

    cap = mlp_forward_nodes["forward"]
    _, base = fsdp_passes.reorder_scheduler_nodes(cap, Options(reorder=False))
    _, other_cluster = fsdp_passes.reorder_scheduler_nodes(cap, Options(reorder=False, cluster="cpu-gloo"))
    assert other_cluster.makespan_ms_before > 10 * base.makespan_ms_before
    # a calibration table saying all-gathers take 1 s at every size
    cal = Calibration()
    for nbytes in (1, 1 << 30):
        cal.add_collective("all_gather", 8, nbytes, 1000.0)
    path = tmp_path / "cal.json"
    cal.save(path)
    _, calibrated = fsdp_passes.reorder_scheduler_nodes(cap, Options(reorder=False, calibration=str(path)))
    dag = _dag(cap)
    n_ag = len(dag.collectives())
    assert calibrated.makespan_ms_before >= 1000.0 * n_ag
    json.loads(path.read_text())  # the table is plain JSON


def test_kernel_keys_are_skipped_only_where_nothing_reads_them(mlp_forward_nodes, tmp_path):
    import dataclasses

    from fsdp_passes.cost_model import Calibration

    cap = mlp_forward_nodes["backward"]
    with cap.graph_context():
        keyed = dag_from_scheduler_nodes(cap.before)
        bare = dag_from_scheduler_nodes(cap.before, kernel_keys=False)
    assert any(n.kernel_key for n in keyed) and not any(n.kernel_key for n in bare)
    for a, b in zip(keyed, bare):  # everything else the same
        assert dataclasses.replace(a, kernel_key=None) == b and a.origin is b.origin
    # a calibration's kernel times are still found: one kernel measured at 1 s is in the makespan
    key = next(n.kernel_key for n in keyed if n.kernel_key and n.kind is NodeKind.COMPUTE)
    cal = Calibration()
    cal.add_kernel(key, 1000.0)
    path = tmp_path / "kernels.json"
    cal.save(path)
    _, base = fsdp_passes.reorder_scheduler_nodes(cap, Options(reorder=False))
    _, calibrated = fsdp_passes.reorder_scheduler_nodes(cap, Options(reorder=False, calibration=str(path)))
    assert calibrated.makespan_ms_before >= base.makespan_ms_before + 900.0
    # and the dump's dag.json still carries them
    fsdp_passes.reorder_scheduler_nodes(cap, Options(reorder=False, debug_dir=str(tmp_path / "dump")))
    (dag_json,) = tmp_path.glob("dump/**/dag.json")
    assert key in {n.get("kernel_key") for n in json.loads(dag_json.read_text())["nodes"]}


def test_the_plan_and_its_report_price_the_profiles_overlap_costs(mlp_forward_nodes):
    """A profile's overlap costs (host issue time per collective, compute slowed while one is in flight) are
    what the scheduler pass plans and reports with: its figures are the replay of its order under those terms
    (computed here from the numbers given), and every issue costs the compute stream its time."""
    from fsdp_passes.cost_model import CostModel, load_profile
    from fsdp_passes.simulate import OverlapCosts, simulate

    cap = mlp_forward_nodes["forward"]
    free = {"base": "h100-nvlink", "collective_issue_us": 0.0, "compute_slowdown_during_comm": 0.0}
    costly = dict(free, collective_issue_us=30.0, compute_slowdown_during_comm=1.0)
    dag = _dag(cap)
    index = {id(n): i for i, n in enumerate(cap.before)}
    durations = CostModel(load_profile(free)).estimate(dag)  # the overlap terms do not change node times
    overlap = OverlapCosts(issue_ms=0.030, compute_slowdown=1.0)
    identity = list(range(len(dag)))
    new, report = fsdp_passes.reorder_scheduler_nodes(cap, Options(cluster=costly, memory_budget="100%"))
    order = [index[id(n)] for n in new]
    assert report.makespan_ms_after == pytest.approx(simulate(dag, order, durations, overlap).makespan)
    assert report.makespan_ms_before == pytest.approx(simulate(dag, identity, durations, overlap).makespan)
    assert report.exposed_comm_ms_after == pytest.approx(simulate(dag, order, durations, overlap).exposed_total)
    n_collectives = len(dag.collectives())
    assert report.makespan_ms_before >= simulate(dag, identity, durations).makespan + 0.030 * n_collectives - 1e-9
