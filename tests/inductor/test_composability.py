"""The passes composed with other parallelisms and training features, on a fake 8-rank process group.

- HSDP (2 x 4 mesh: replicate x shard): gathers / reduce-scatters on the shard group, gradient all-reduces
  on the replicate group;
- tensor parallel + FSDP (4 x 2 mesh: dp x tp): TP all-reduces inside each block on the TP group;
- activation checkpointing (reshard after forward): all-gathers recomputed in backward;
- mixed precision: bf16 parameters, fp32 gradient reduction;
- other collectives (all-to-all, broadcast) in the graph.

Structure only (a fake group moves no data); numerics are in tests/inductor/test_composability_gloo.py (TP + FSDP), tests/frontend/test_frontend_gloo.py (HSDP) and tests/inductor/test_numerics_gloo.py (FSDP, mixed precision, rank consistency).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.fx as fx
from torch.distributed.device_mesh import init_device_mesh

from fsdp_passes.bucketing import BUCKET_META_KEY
from fsdp_passes.pipeline import bucket_graph
from fsdp_passes.cost_model import CostModel
from fsdp_passes.dag import CollectiveOp, NodeKind
from fsdp_passes.dag.from_fx import dag_from_fx
from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
from fsdp_passes.options import Options
from fsdp_passes.simulate import simulate
from fsdp_passes.testing import (
    build_mlp,
    capture_fx_graphs,
    capture_scheduler_nodes,
    example_inputs,
    fake_process_group,
    fsdp_param_of,
)
from fsdp_passes.testing.models import build_tp_mlp, hsdp

pytestmark = pytest.mark.usefixtures("fresh_inductor")

c10d = torch.ops._c10d_functional
AUTO = dict(bucketing="auto", memory_budget="1GB", strict=True, cluster="cpu-gloo")
PER_LAYER = dict(bucketing="manual", bucket_plan=["layers.[0-1]"], strict=True, memory_budget="1GB")


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return fx.GraphModule(gm, g)


def _collectives(dag):
    return [dag.nodes[i] for i in dag.collectives()]


def _scheduler_orders(captures):
    """Per captured graph: (dag of the input order, order the passes chose as ids of that dag)."""
    out = []
    for cap in captures:
        dag = dag_from_scheduler_nodes(cap.before)
        index = {id(n): i for i, n in enumerate(cap.before)}
        out.append((cap, dag, [index[id(n)] for n in cap.after]))
    return out


def _compute_before(dag, order):
    """Per node id: how many compute nodes run before it in ``order``."""
    count, out = 0, {}
    for i in order:
        out[i] = count
        if dag.nodes[i].kind is NodeKind.COMPUTE:
            count += 1
    return out


def _check_schedule(dag, order):
    assert dag.order_violations(order) == []
    pos = {i: p for p, i in enumerate(order)}
    for group, seq in dag.group_sequences().items():
        assert sorted(seq, key=pos.__getitem__) == seq, f"group {group} reordered"


@pytest.fixture(scope="module")
def world():
    """One fake 8-rank process group for the whole module (the DAG builders look groups up by name)."""
    with fake_process_group(8) as group:
        yield group


# -- HSDP ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hsdp_setup(world):
    if True:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        replicate, shard = mesh.get_group(0).group_name, mesh.get_group(1).group_name
        model = hsdp(build_mlp(2, 32, fsdp=False), mesh)
        graphs = capture_fx_graphs(model, *example_inputs(model))
        caps = capture_scheduler_nodes(model, *example_inputs(model), options=PER_LAYER)
        return {"replicate": replicate, "shard": shard, "graphs": graphs, "caps": caps, "mesh": mesh}


def test_hsdp_dag_sees_two_groups(hsdp_setup):
    s = hsdp_setup
    bwd = dag_from_fx(s["graphs"].backward.graph)
    by_op = {}
    for n in _collectives(bwd):
        by_op.setdefault(n.collective, set()).add(n.group_name)
    assert by_op[CollectiveOp.ALL_GATHER] == {s["shard"]}
    assert by_op[CollectiveOp.REDUCE_SCATTER] == {s["shard"]}
    assert by_op[CollectiveOp.ALL_REDUCE] == {s["replicate"]}
    assert set(bwd.group_sequences()) == {s["shard"], s["replicate"]}
    # the replicate all-reduces are gradient reductions, as the reduce-scatters feeding them
    assert all(n.fsdp for n in _collectives(bwd))
    assert {n.group_size for n in _collectives(bwd) if n.group_name == s["replicate"]} == {2}


@pytest.mark.parametrize("options", [AUTO, PER_LAYER], ids=["auto", "manual"])
def test_hsdp_buckets_never_cross_groups(hsdp_setup, options):
    s = hsdp_setup
    gm = _copy(s["graphs"].backward)
    before = dag_from_fx(gm.graph)
    result = bucket_graph(gm, Options(**options))
    assert result.merged, "nothing bucketed"
    for b in result.buckets:
        groups = {before.nodes[m].group_name for m in b.members}
        ops = {before.nodes[m].collective for m in b.members}
        assert groups == {b.group_name} and ops == {b.op}
    after = dag_from_fx(gm.graph)
    count = lambda dag, op: Counter(n.group_name for n in _collectives(dag) if n.collective is op)  # noqa: E731
    # the gradient all-reduces of the replicate group are bucketed too (the FX planner handles all-reduces)
    assert count(after, CollectiveOp.ALL_REDUCE)[s["replicate"]] < count(before, CollectiveOp.ALL_REDUCE)[s["replicate"]]
    assert count(after, CollectiveOp.REDUCE_SCATTER)[s["shard"]] < count(before, CollectiveOp.REDUCE_SCATTER)[s["shard"]]
    assert set(count(after, CollectiveOp.ALL_REDUCE)) == {s["replicate"]}
    # every merged collective still runs on the group of its members
    for n in gm.graph.nodes:
        tag = n.meta.get(BUCKET_META_KEY)
        if tag and n.target is c10d.all_reduce.default:
            assert n.args[2] == s["replicate"]
    gm.graph.lint()


def test_hsdp_reordering_keeps_each_group_order_and_two_streams(hsdp_setup):
    s = hsdp_setup
    cm = CostModel.from_options("h100-nvlink")
    seen_groups = set()
    for cap, dag, order in _scheduler_orders(s["caps"]):
        _check_schedule(dag, order)
        seqs = dag.group_sequences()
        seen_groups |= set(seqs)
        timeline = simulate(dag, order, cm.estimate(dag))
        # one FIFO stream per process group: each group present in the graph has its own busy time
        assert set(timeline.comm_time) == set(seqs)
        if len(seqs) == 2:
            # on separate streams the replicate all-reduce can run while the shard group reduce-scatters
            rs = [i for i in seqs[s["shard"]] if dag.nodes[i].collective is CollectiveOp.REDUCE_SCATTER]
            ar = seqs[s["replicate"]]
            assert rs and ar
    assert seen_groups == {s["shard"], s["replicate"]}


# -- tensor parallel + FSDP -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp_setup(world):
    if True:
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_group(0), mesh.get_group(1)
        model = build_tp_mlp(2, 32, tp_group=tp, dp_group=dp)
        graphs = capture_fx_graphs(model, *example_inputs(model))
        caps = capture_scheduler_nodes(model, *example_inputs(model), options=AUTO)
        return {"dp": dp.group_name, "tp": tp.group_name, "graphs": graphs, "caps": caps}


def test_tp_collectives_are_not_fsdp_and_never_bucketed(tp_setup):
    s = tp_setup
    for gm0 in (s["graphs"].forward, s["graphs"].backward):
        dag = dag_from_fx(gm0.graph)
        tp_nodes = [n for n in _collectives(dag) if n.group_name == s["tp"]]
        assert tp_nodes and all(n.collective is CollectiveOp.ALL_REDUCE and not n.fsdp for n in tp_nodes)
        assert all(n.fsdp for n in _collectives(dag) if n.group_name == s["dp"])
        for options in (AUTO, PER_LAYER):
            gm = _copy(gm0)
            result = bucket_graph(gm, Options(**options))
            tp_ids = {dag.index[n.name] for n in tp_nodes}
            assert all(not (set(b.members) & tp_ids) or len(b) == 1 for b in result.buckets)
            assert all(b.group_name == s["dp"] for b in result.merged)
            after = dag_from_fx(gm.graph)
            assert sorted(n.name for n in _collectives(after) if n.group_name == s["tp"]) == sorted(
                n.name for n in tp_nodes)
    # the forward FSDP gathers of one layer do get merged
    gm = _copy(s["graphs"].forward)
    assert bucket_graph(gm, Options(**PER_LAYER)).merged


def test_tp_collectives_never_delayed_by_reordering(tp_setup):
    s = tp_setup
    n_tp = 0
    for cap, dag, order in _scheduler_orders(s["caps"]):
        _check_schedule(dag, order)
        before = _compute_before(dag, list(range(len(dag))))
        after = _compute_before(dag, order)
        for i in dag.collectives():
            if dag.nodes[i].group_name == s["tp"]:
                n_tp += 1
                assert not dag.nodes[i].fsdp
                assert dag.nodes[i].dtype == "float32"  # in-place all_reduce_: dtype from its input
                assert after[i] <= before[i], f"{dag.nodes[i].name} issued later relative to compute"
    assert n_tp >= 3  # two forward all-reduces, one backward


# -- activation checkpointing / reshard after forward ---------------------------------------------------------

@pytest.fixture(scope="module")
def ac_setup(world):
    if True:
        model = build_mlp(3, 32, reshard_after_forward=True)
        graphs = capture_fx_graphs(model, *example_inputs(model))
        caps = capture_scheduler_nodes(model, *example_inputs(model), options=PER_LAYER | {"bucket_plan": ["layers.[0-2]"]})
        return {"graphs": graphs, "caps": caps}


def _gathered_params(gm):
    params = []
    for n in gm.graph.nodes:
        if n.target is c10d.all_gather_into_tensor.default:
            tag = n.meta.get(BUCKET_META_KEY)
            params.extend(tag["params"] if tag else [fsdp_param_of(n)])
    return params


@pytest.mark.parametrize("options", [AUTO, {"bucketing": "manual", "bucket_plan": ["layers.[0-2]"], "strict": True, "memory_budget": "1GB"}],
                         ids=["auto", "manual"])
def test_recomputed_gathers_bucketed_once(ac_setup, options):
    bwd0 = ac_setup["graphs"].backward
    before = _gathered_params(bwd0)
    assert before and all(before) and len(set(before)) == len(before)
    gm = _copy(bwd0)
    result = bucket_graph(gm, Options(**options))
    assert any(b.op is CollectiveOp.ALL_GATHER for b in result.merged), "backward re-gathers not bucketed"
    after = _gathered_params(gm)
    n_ag = lambda g: sum(n.target is c10d.all_gather_into_tensor.default for n in g.graph.nodes)  # noqa: E731
    assert n_ag(gm) <= n_ag(bwd0)
    # each parameter gathered exactly once per backward, none duplicated or lost
    assert sorted(after) == sorted(before)


def test_recomputed_gathers_prefetched_in_backward(ac_setup):
    caps = ac_setup["caps"]
    assert len(caps) == 2
    for cap, dag, order in _scheduler_orders(caps):
        _check_schedule(dag, order)
    cap, dag, order = _scheduler_orders(caps)[1]  # backward
    before = _compute_before(dag, list(range(len(dag))))
    after = _compute_before(dag, order)
    gathers = [i for i in dag.collectives() if dag.nodes[i].collective is CollectiveOp.ALL_GATHER]
    assert len(gathers) >= 2
    assert all(after[i] <= before[i] for i in gathers)
    assert any(after[i] < before[i] for i in gathers), "no backward all-gather was issued earlier"


# -- mixed precision ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mp_graphs(world):
    if True:
        model = build_mlp(2, 32, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return capture_fx_graphs(model, *example_inputs(model))


def test_mixed_precision_cast_feeds_copy_in(mp_graphs):
    fwd = _copy(mp_graphs.forward)
    result = bucket_graph(fwd, Options(**PER_LAYER))
    assert result.merged and {b.dtype for b in result.merged} == {"bfloat16"}
    merged = [n for n in fwd.graph.nodes if n.target is c10d.all_gather_into_tensor.default and BUCKET_META_KEY in n.meta]
    assert merged
    for ag in merged:
        assert ag.meta["val"].dtype == torch.bfloat16
        # walk back from the merged gather's input: the bf16 casts of the fp32 shards feed the copy-in
        stack, seen, casts = [ag.args[0]], set(), 0
        while stack:
            n = stack.pop()
            if n in seen or n.op != "call_function":
                continue
            seen.add(n)
            if n.target is torch.ops.prims.convert_element_type.default or n.target is torch.ops.aten._to_copy.default:
                casts += 1
                assert n.meta["val"].dtype == torch.bfloat16
                continue
            stack.extend(n.all_input_nodes)
        assert casts == len(ag.meta[BUCKET_META_KEY]["members"])


def test_mixed_precision_fp32_gradient_reduction(mp_graphs):
    bwd = _copy(mp_graphs.backward)
    dag = dag_from_fx(bwd.graph)
    assert {n.dtype for n in _collectives(dag) if n.collective is CollectiveOp.REDUCE_SCATTER} == {"float32"}
    assert {n.dtype for n in _collectives(dag) if n.collective is CollectiveOp.ALL_GATHER} == {"bfloat16"}
    result = bucket_graph(bwd, Options(**PER_LAYER))
    assert {(b.op, b.dtype) for b in result.merged} >= {(CollectiveOp.REDUCE_SCATTER, "float32")}
    for b in result.buckets:  # never a bucket of two dtypes
        assert {dag.nodes[m].dtype for m in b.members} == {b.dtype}
    for n in bwd.graph.nodes:
        if n.target is c10d.reduce_scatter_tensor.default:
            assert n.meta["val"].dtype == torch.float32


# -- other collectives ------------------------------------------------------------------------------------------

class _OtherCollectives(torch.nn.Module):
    """An FSDP MLP with an all-to-all and a broadcast (functional collectives, world group) in forward."""

    def __init__(self, inner, group_name):
        super().__init__()
        self.inner = inner
        self.group_name = group_name
        self.dim = inner.dim

    def forward(self, x):
        h = self.inner.layers[0](x)
        a2a = c10d.all_to_all_single(h.contiguous(), [1] * 8, [1] * 8, self.group_name)
        h = h + c10d.wait_tensor(a2a)
        b = c10d.broadcast(h.contiguous(), 0, self.group_name)
        h = h * c10d.wait_tensor(b)
        return self.inner.layers[1](h)


def test_other_collectives_never_bucketed_nor_moved_across(world):
    if True:
        inner = build_mlp(2, 32)
        model = _OtherCollectives(inner, world.group_name)
        x = torch.randn(8, 32)
        graphs = capture_fx_graphs(model, x, backward=False)
        caps = capture_scheduler_nodes(model, x, backward=False, options=AUTO)
    dag = dag_from_fx(graphs.forward.graph)
    kinds = Counter(n.collective for n in _collectives(dag))
    assert kinds[CollectiveOp.ALL_TO_ALL] == 1 and kinds[CollectiveOp.OTHER] == 1
    gm = _copy(graphs.forward)
    result = bucket_graph(gm, Options(**PER_LAYER))
    others = {i for i in dag.collectives() if dag.nodes[i].collective in (CollectiveOp.ALL_TO_ALL, CollectiveOp.OTHER)}
    for i in others:
        assert "not bucketed" in result.unbucketed[dag.nodes[i].name]
    assert all(not (set(b.members) & others) for b in result.merged)
    assert result.merged  # the FSDP gathers around them still are
    for cap, sdag, order in _scheduler_orders(caps):
        _check_schedule(sdag, order)
        pos = {i: p for p, i in enumerate(order)}
        before = _compute_before(sdag, list(range(len(sdag))))
        after = _compute_before(sdag, order)
        special = [i for i in sdag.collectives() if sdag.nodes[i].collective in (CollectiveOp.ALL_TO_ALL, CollectiveOp.OTHER)]
        assert len(special) == 2
        for i in special:
            assert after[i] <= before[i]  # never delayed
            if sdag.nodes[i].collective is CollectiveOp.OTHER:
                assert after[i] == before[i]  # a broadcast is not issued early either
                # no later collective is issued before it
                assert all(pos[j] > pos[i] for j in sdag.collectives() if j > i)
