"""The neutral DAG: built from FX graphs and from scheduler nodes, queries, order checks, exports."""

import pytest

from fsdp_passes.dag import CollectiveOp, Dag, DagNode, NodeKind
from fsdp_passes.dag.from_fx import dag_from_fx, normalize_module_path
from fsdp_passes.testing import build_mlp, capture_fx_graphs, capture_scheduler_nodes, example_inputs


def _collective_summary(dag):
    return [(n.collective, n.group_name, n.comm_bytes, n.group_size) for n in dag if n.kind is NodeKind.COLLECTIVE]


@pytest.fixture
def mlp_captures(fake_pg, fresh_inductor):
    model = build_mlp(n_layers=2, dim=32, reshard_after_forward=True)
    inputs = example_inputs(model)
    fx_graphs = capture_fx_graphs(model, *inputs)
    sched = capture_scheduler_nodes(model, *inputs)
    return fx_graphs, sched


def test_fx_and_scheduler_dags_agree_on_collectives(mlp_captures):
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes

    fx_graphs, sched = mlp_captures
    fwd_fx, bwd_fx = dag_from_fx(fx_graphs.forward), dag_from_fx(fx_graphs.backward)
    by_name = {c.graph_name: c for c in sched}
    # inside the compile's graph context: which buffers are graph outputs decides what a gradient is
    with by_name["forward"].graph_context():
        fwd_s = dag_from_scheduler_nodes(by_name["forward"].before)
    with by_name["backward"].graph_context():
        bwd_s = dag_from_scheduler_nodes(by_name["backward"].before)
    # forward: 2 layers x 2 weights (+ biases) all-gathered; backward re-gathers and reduce-scatters
    assert _collective_summary(fwd_fx) == _collective_summary(fwd_s)
    assert _collective_summary(bwd_fx) == _collective_summary(bwd_s)
    ops = {n.collective for n in bwd_fx if n.kind is NodeKind.COLLECTIVE}
    assert ops == {CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER}
    for dag in (fwd_fx, bwd_fx, fwd_s, bwd_s):
        for i in dag.collectives():
            node = dag[i]
            assert node.group_size == 8 and node.group_ranks == tuple(range(8))
            assert node.fsdp, node.name
            waits = dag.waits_of(i)
            assert len(waits) == 1 and dag[waits[0]].collective_of == i and dag[waits[0]].alias_of == i
        assert dag.order_violations(list(range(len(dag)))) == []
    # every all-gather in the FX forward names the parameter shard it gathers
    assert all(fwd_fx[i].param_fqn for i in fwd_fx.collectives())


def test_fx_dag_bytes_and_flops(mlp_captures):
    fx_graphs, _ = mlp_captures
    dag = dag_from_fx(fx_graphs.forward)
    for i in dag.collectives():
        node = dag[i]
        shard = node.origin.args[0].meta["val"]
        assert node.comm_bytes == shard.numel() * shard.element_size() * 8  # full gathered size
    mms = [n for n in dag if n.op.startswith("aten.mm") or n.op.startswith("aten.addmm")]
    assert mms and all(n.flops > 0 for n in mms)


def _chain_dag():
    nodes = [
        DagNode("ag0", NodeKind.COLLECTIVE, collective=CollectiveOp.ALL_GATHER, group_name="0", out_bytes=8),
        DagNode("w0", NodeKind.WAIT, collective_of=0, alias_of=0),
        DagNode("mm0", NodeKind.COMPUTE, out_bytes=4),
        DagNode("ag1", NodeKind.COLLECTIVE, collective=CollectiveOp.ALL_GATHER, group_name="0", out_bytes=8),
        DagNode("w1", NodeKind.WAIT, collective_of=3, alias_of=3),
        DagNode("mm1", NodeKind.COMPUTE, out_bytes=4, is_output=True),
    ]
    return Dag(nodes, [(0, 1), (1, 2), (3, 4), (2, 5), (4, 5)])


def test_reaches_and_order_violations():
    dag = _chain_dag()
    assert dag.reaches(0, 5) and dag.reaches(3, 5) and not dag.reaches(5, 0) and not dag.reaches(0, 3)
    assert dag.ancestors_mask(5) == sum(1 << i for i in (0, 1, 2, 3, 4))
    assert dag.order_violations([3, 0, 1, 2, 4, 5])  # ag1 issued before ag0: group order changed
    assert "placed before its input" in dag.order_violations([1, 0, 2, 3, 4, 5])[0]
    assert "not a permutation" in dag.order_violations([0, 1, 2])[0]
    assert dag.order_violations([0, 3, 1, 2, 4, 5]) == []  # prefetching ag1 is allowed
    assert dag.group_sequences() == {"0": [0, 3]}


def test_cycle_and_bad_edges_rejected():
    nodes = [DagNode("a", NodeKind.COMPUTE), DagNode("b", NodeKind.COMPUTE)]
    with pytest.raises(ValueError, match="cycle"):
        Dag(nodes, [(0, 1), (1, 0)])
    with pytest.raises(ValueError, match="outside"):
        Dag(nodes, [(0, 7)])
    with pytest.raises(ValueError, match="duplicate"):
        Dag([DagNode("a", NodeKind.COMPUTE)] * 2, [])


def test_exports():
    dag = _chain_dag()
    g = dag.to_networkx()
    assert g.number_of_nodes() == 6 and g.number_of_edges() == 5
    import networkx as nx

    assert list(nx.topological_sort(g))[0] in (0, 3)
    dot = dag.to_dot()
    assert dot.startswith('digraph "dag"') and dot.count("->") == 5 and "all_gather" in dot


def test_reaches_on_a_large_chain_is_windowed():
    n = 100_000
    nodes = [DagNode(f"n{i}", NodeKind.COMPUTE) for i in range(n)]
    dag = Dag(nodes, [(i, i + 1) for i in range(n - 1)])
    assert dag.reaches(n - 3, n - 1) and not dag.reaches(n - 1, 0)


@pytest.mark.parametrize(
    "raw, expected",
    [("L['self'].layers[0].attn", "layers.0.attn"), ("layers.1.mlp", "layers.1.mlp"), ("L['self'].norm", "norm")],
)
def test_normalize_module_path(raw, expected):
    assert normalize_module_path(raw) == expected


def test_graph_inputs_are_resident_bytes_in_both_builders(mlp_captures):
    """Parameter shards and saved activations are the graph's inputs: both DAGs count the same bytes.  A
    percentage memory budget is a percentage of a reference the caller gives (the FSDP payload)."""
    from fsdp_passes import Options
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes

    fx_graphs, sched = mlp_captures
    for cap, gm in ((sched[0], fx_graphs.forward), (sched[1], fx_graphs.backward)):
        with cap.graph_context():
            s_dag = dag_from_scheduler_nodes(cap.before)
        f_dag = dag_from_fx(gm)
        expected = sum(n.meta["val"].numel() * n.meta["val"].element_size()
                       for n in gm.graph.nodes if n.op == "placeholder")
        assert f_dag.resident_bytes == s_dag.resident_bytes == expected > 0
    assert Options(memory_budget="10%").memory_budget_bytes(10000, 0) == 1000


def test_out_variant_collectives_are_priced_by_their_payload(fake_pg, fresh_inductor):
    """Inductor's own bucketing emits all_gather_into_tensor_out (no output buffer of its own): the
    scheduler DAG still charges the gathered bytes."""
    import torch._inductor.config as ic

    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes

    model = build_mlp(n_layers=2, dim=32, reshard_after_forward=False)
    with ic.patch(bucket_all_gathers_fx="all"):
        caps = capture_scheduler_nodes(model, *example_inputs(model))
    cap = caps[0]
    with cap.graph_context():
        dag = dag_from_scheduler_nodes(cap.before)
    gathers = [dag[i] for i in dag.collectives() if dag[i].collective is CollectiveOp.ALL_GATHER]
    assert gathers and any("_out" in g.op for g in gathers)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert sum(g.comm_bytes for g in gathers) == shard_bytes * 8


def test_fx_and_scheduler_dags_count_the_same_flops(mlp_captures):
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes

    fx_graphs, sched = mlp_captures
    for cap, gm in ((sched[0], fx_graphs.forward), (sched[1], fx_graphs.backward)):
        with cap.graph_context():
            s_flops = sum(n.flops for n in dag_from_scheduler_nodes(cap.before))
        f_flops = sum(n.flops for n in dag_from_fx(gm))
        assert s_flops == f_flops > 0, (cap.graph_name, s_flops, f_flops)


def test_dag_node_copy_is_shallow_and_keeps_every_field():
    import copy
    import dataclasses

    from fsdp_passes.dag.graph import CollectiveOp, DagNode, NodeKind, OutputBuffer

    origin = object()
    values = {"name": "ag", "kind": NodeKind.COLLECTIVE, "op": "_c10d_functional.all_gather_into_tensor.default",
              "collective": CollectiveOp.ALL_GATHER, "group_name": "0", "group_size": 8, "group_ranks": tuple(range(8)),
              "reduce_op": "sum", "comm_bytes": 64, "in_bytes": 8, "out_bytes": 64, "dtype": "bfloat16", "flops": 1.5,
              "alias_of": 3, "collective_of": 2, "is_output": True, "fsdp": True, "module_fqn": "layers.0",
              "param_fqn": "layers.0.w", "kernel_key": "k", "launches_kernel": False, "input_reads": {"x": 4},
              "non_owning_bytes": 5, "graph_output_bytes": 6, "output_buffers": (OutputBuffer(nbytes=64, readers=("mm",)),),
              "kernel_group": 7, "origin": origin}
    # every field is set to a value other than its default, so a field the copy dropped would show
    assert set(values) == {f.name for f in dataclasses.fields(DagNode)}
    node = DagNode(**values)
    twin = copy.copy(node)
    assert twin is not node
    for name, value in values.items():
        assert getattr(twin, name) is getattr(node, name), name  # shallow: the same objects
    twin.out_bytes = 1
    assert node.out_bytes == 64
