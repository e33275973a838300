"""Bucketing: plans (manual patterns, auto) and the FX rewrite.

Numerics on a real gloo group (bucketed equals unbucketed bitwise): tests/inductor/test_numerics_gloo.py.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
import torch.fx as fx

from fsdp_passes.bucketing import (
    BUCKET_META_KEY,
    UnmatchedPlanEntry,
    apply_buckets,
    expand_plan,
    plan_auto,
    plan_cycles,
    plan_manual,
)
from fsdp_passes.bucketing.manual import matches
from fsdp_passes.pipeline import bucket_graph
from fsdp_passes.simulate import OverlapCosts
from fsdp_passes.bucketing.plan import make_bucket
from fsdp_passes.dag.from_fx import dag_from_fx
from fsdp_passes.dag.graph import CollectiveOp, Dag, DagNode, NodeKind
from fsdp_passes.options import Options

N_LAYERS = 4
WORLD = 4
PER_LAYER_PLAN = [f"layers.[0-{N_LAYERS - 1}]"]

c10d = torch.ops._c10d_functional


# -- helpers ----------------------------------------------------------------------------------------------------

def _capture(**fsdp_options):
    from fsdp_passes.testing import build_mlp, capture_fx_graphs, example_inputs, fake_process_group

    torch._dynamo.reset()
    with fake_process_group(world_size=WORLD):
        model = build_mlp(N_LAYERS, 16, reshard_after_forward=True, **fsdp_options)
        graphs = capture_fx_graphs(model, *example_inputs(model, seed=0))
    torch._dynamo.reset()
    return graphs.forward, graphs.backward


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def _collectives(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (
        c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)]


def _counts(gm: fx.GraphModule) -> Counter:
    return Counter(n.target.__name__.split(".")[0] for n in _collectives(gm))


def _layer_of(fqn: str) -> str:
    return ".".join(fqn.split(".")[:2])


def _check_order(gm: fx.GraphModule) -> None:
    gm.graph.lint()  # every argument defined before use
    seen: set[fx.Node] = set()
    for n in gm.graph.nodes:
        assert all(a in seen for a in n.all_input_nodes), n.name
        seen.add(n)
        if n.op == "call_function":
            assert isinstance(n.meta.get("val"), (torch.Tensor, list, tuple)) or n.meta.get("val") is None, n.name
    for n in _collectives(gm):
        users = list(n.users)
        assert len(users) == 1 and users[0].target is c10d.wait_tensor.default, n.name


def _value_meta(v):
    return (tuple(v.shape), v.dtype, tuple(v.stride()))


def _wait_metas(gm: fx.GraphModule) -> dict[tuple[str, int], tuple]:
    """(user name, arg index) -> meta of the wait value it reads, for every user of a collective's wait."""
    out = {}
    for c in _collectives(gm):
        w = next(iter(c.users))
        for u in w.users:
            for k, a in enumerate(u.args if u.op != "output" else u.args[0]):
                if a is w:
                    out[(u.name, k)] = _value_meta(w.meta["val"])
    return out


@pytest.fixture(scope="module")
def mlp_graphs():
    return _capture()


@pytest.fixture(scope="module")
def mixed_graphs():
    return _capture(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# -- plan parsing -----------------------------------------------------------------------------------------------

def test_expand_plan_ranges_lists_and_matching():
    entries = expand_plan(["tok_embeddings", "layers.[0-31]", ["norm", "output"], "blocks.[1,3].attn"])
    labels = [label for label, _ in entries]
    assert labels[0] == "tok_embeddings"
    assert labels[1:33] == [f"layers.{i}" for i in range(32)]
    assert entries[33] == ("[norm, output]", ["norm", "output"])
    assert labels[34:] == ["blocks.1.attn", "blocks.3.attn"]
    assert expand_plan([["layers.[0-1]", "norm"]]) == [("[layers.[0-1], norm]", ["layers.0", "layers.1", "norm"])]
    assert matches("layers.1.fc1.weight", "layers.1")
    assert not matches("layers.10.fc1.weight", "layers.1")
    assert matches("layers.3.attention.wq.weight", "layers.*.attention")
    assert matches("output.weight", "output") and not matches("outputs.weight", "output")
    with pytest.raises(ValueError, match=r"\[3-1\]"):
        expand_plan(["layers.[3-1]"])


# -- manual plans on the 4-block toy -----------------------------------------------------------------------------

def test_manual_per_block_one_collective_per_block(mlp_graphs):
    fwd, bwd = (_copy(g) for g in mlp_graphs)
    assert _counts(fwd) == {"all_gather_into_tensor": 4 * N_LAYERS}
    before_bwd = _counts(bwd)
    assert before_bwd["reduce_scatter_tensor"] == 4 * N_LAYERS and before_bwd["all_gather_into_tensor"] > 0

    options = Options(bucketing="manual", bucket_plan=PER_LAYER_PLAN, memory_budget="1GB")  # the plan as asked
    r_fwd = bucket_graph(fwd, options)
    r_bwd = bucket_graph(bwd, options)
    assert r_fwd.n_collectives_after == N_LAYERS == len(_collectives(fwd))
    assert not r_fwd.unbucketed and not r_bwd.unbucketed

    for gm in (fwd, bwd):
        _check_order(gm)
        per_kind_layer = Counter()
        for c in _collectives(gm):
            tag = c.meta.get(BUCKET_META_KEY)
            params = tag["params"] if tag else [c.meta["custom"]["fsdp_param"]]
            layers = {_layer_of(p) for p in params}
            assert len(layers) == 1, params  # a bucket never spans two blocks
            per_kind_layer[(c.target, layers.pop())] += 1
        assert all(v == 1 for v in per_kind_layer.values()), per_kind_layer
    # forward: one gather per block; backward: one reduce-scatter per block and one re-gather per block that
    # re-gathers at all
    fwd_layers = {_layer_of(p) for c in _collectives(fwd) for p in c.meta[BUCKET_META_KEY]["params"]}
    assert fwd_layers == {f"layers.{i}" for i in range(N_LAYERS)}
    assert _counts(bwd)["reduce_scatter_tensor"] == N_LAYERS
    regathered = {_layer_of(p) for c in mlp_graphs[1].graph.nodes
                  if c.op == "call_function" and c.target is c10d.all_gather_into_tensor.default
                  for p in [c.meta["custom"]["fsdp_param"]]}
    assert _counts(bwd)["all_gather_into_tensor"] == len(regathered)
    assert r_bwd.n_collectives_after == N_LAYERS + len(regathered)


def test_rewrite_preserves_shapes_dtypes_strides(mlp_graphs):
    for original in mlp_graphs:
        gm = _copy(original)
        expected = _wait_metas(gm)
        bucket_graph(gm, Options(bucketing="manual", bucket_plan=PER_LAYER_PLAN, memory_budget="1GB"))
        by_name = {n.name: n for n in gm.graph.nodes}
        for (user, k), meta in expected.items():
            node = by_name[user]
            arg = (node.args if node.op != "output" else node.args[0])[k]
            assert _value_meta(arg.meta["val"]) == meta, (user, arg.name)


def test_merged_gather_copies_its_members_out_at_once(mlp_graphs):
    """A merged all-gather's members are [n, numel] columns of the gathered buffer: one op copies them all out
    (``copy_out_members``: one extern kernel, no generated copy per member), right after the wait, and what
    read a member reads a view of that op's output."""
    aten = torch.ops.aten
    copy_out = torch.ops.fsdp_passes.copy_out_members.default
    gm = _copy(mlp_graphs[0])
    bucket_graph(gm, Options(bucketing="manual", bucket_plan=PER_LAYER_PLAN, memory_budget="1GB"))
    merged = [c for c in _collectives(gm) if BUCKET_META_KEY in c.meta]
    assert len(merged) == N_LAYERS
    assert all(c.target is c10d.all_gather_into_tensor.default for c in merged)
    for c in merged:
        wait = next(iter(c.users))
        (op,) = wait.users
        assert op.target is copy_out
        assert len(op.args[1]) == len(c.meta[BUCKET_META_KEY]["members"])
        assert wait.next is op
        (split,) = op.users  # member i: a view of the i-th block of the op's output, read by what read it
        assert split.target is aten.split_with_sizes.default
        assert len(split.users) == len(op.args[1])
        for item in split.users:
            assert item.target.__name__ == "getitem"
            (view,) = item.users
            # a 1-D member (a bias), and only it, gets a buffer of its own: kernels reading it then do not
            # depend on its offset in the bucket
            own = view.target is torch.ops.fsdp_passes.copy_in_members.default
            if own:
                (view,) = view.users
            assert own == (view.meta["val"].dim() == 1)
            assert view.target is aten.view.default
            assert view.users and all(u.target is not aten.reshape.default for u in view.users)


def test_merged_collective_placement(mlp_graphs):
    gm = _copy(mlp_graphs[1])
    dag = dag_from_fx(gm.graph)
    rs = [i for i in dag.collectives() if dag.nodes[i].collective is CollectiveOp.REDUCE_SCATTER]
    first = rs[:4]  # the last block's four gradient reduce-scatters
    bucket = make_bucket(dag, first, close_reason="plan")
    inputs = {dag.nodes[i].origin.args[0].name for i in first}
    consumers = {u.name for i in first for u in next(iter(dag.nodes[i].origin.users)).users}
    apply_buckets(gm, dag, [bucket])
    order = [n.name for n in gm.graph.nodes]
    coll = next(n for n in gm.graph.nodes if BUCKET_META_KEY in n.meta and n.target is c10d.reduce_scatter_tensor.default)
    wait = next(iter(coll.users))
    # issued after its last input, waited on before the first consumer of any member
    assert max(order.index(x) for x in inputs) < order.index(coll.name) < order.index(wait.name)
    assert order.index(wait.name) < min(order.index(u) for u in consumers)
    # nothing but the copy-in sits between the last input and the collective
    between = order[max(order.index(x) for x in inputs) + 1 : order.index(coll.name)]
    assert all(n.startswith(("reshape", "bucket_cat", "view")) for n in between), between
    assert (coll.args[0].target is torch.ops.aten.view.default
            and coll.args[0].args[0].target is torch.ops.fsdp_passes.bucket_cat.default)


# -- auto -------------------------------------------------------------------------------------------------------

def test_auto_reduces_count_and_respects_cap_and_budget(mlp_graphs):
    for original in mlp_graphs:
        unlimited = _copy(original)
        r = bucket_graph(unlimited, Options(bucketing="auto", memory_budget="1GB", cluster="cpu-gloo"))
        assert r.n_collectives_after < r.n_collectives_before
        assert len(_collectives(unlimited)) == r.n_collectives_after
        _check_order(unlimited)

        cap_mb = 4096 / 2**20  # 4 KiB: about one block's gathered weights
        capped = _copy(original)
        rc = bucket_graph(capped, Options(bucketing="auto", memory_budget="1GB", bucket_cap_mb=cap_mb, cluster="cpu-gloo"))
        assert all(b.comm_bytes <= cap_mb * 2**20 for b in rc.merged)
        assert any(b.close_reason == "size_cap" for b in rc.buckets)
        assert rc.n_collectives_after > r.n_collectives_after

        for budget in (6000, 20000):
            tight = _copy(original)
            rm = bucket_graph(tight, Options(bucketing="auto", memory_budget=budget, cluster="cpu-gloo"))
            assert all(b.extra_bytes <= budget for b in rm.buckets)
            # the greedy planner is cut by the budget (auto may then prefer another candidate)
            greedy = next(c for c in rm.choice.candidates if c.name == "greedy")
            assert any(b.close_reason == "memory" for b in greedy.plan.buckets)
            assert rm.n_collectives_after > r.n_collectives_after
            # the rewritten graph's simulated peak grows by at most the budget
            assert rm.report.peak_memory_bytes_after - rm.report.peak_memory_bytes_before <= budget
            assert len(_collectives(tight)) == rm.n_collectives_after

        nothing = _copy(original)
        r0 = bucket_graph(nothing, Options(bucketing="auto", memory_budget=0))
        assert r0.n_collectives_after == r0.n_collectives_before


def test_auto_is_deterministic(mlp_graphs):
    plans = []
    for _ in range(2):
        gm = _copy(mlp_graphs[1])
        plans.append([b.member_names for b in bucket_graph(gm, Options(bucketing="auto", memory_budget="1GB")).buckets])
    assert plans[0] == plans[1]


def test_none_leaves_graph_alone(mlp_graphs):
    gm = _copy(mlp_graphs[0])
    code = gm.code
    r = bucket_graph(gm, Options(bucketing="none"))
    assert r.n_collectives_after == r.n_collectives_before and gm.code == code


# -- mixed precision ---------------------------------------------------------------------------------------------

def test_mixed_dtype_buckets(mixed_graphs):
    fwd, bwd = (_copy(g) for g in mixed_graphs)
    options = Options(bucketing="manual", bucket_plan=PER_LAYER_PLAN, memory_budget="1GB")
    r_fwd, r_bwd = bucket_graph(fwd, options), bucket_graph(bwd, options)
    assert {b.dtype for b in r_fwd.merged} == {"bfloat16"}
    assert {(b.op, b.dtype) for b in r_bwd.merged} == {
        (CollectiveOp.ALL_GATHER, "bfloat16"), (CollectiveOp.REDUCE_SCATTER, "float32")}
    assert r_fwd.n_collectives_after == N_LAYERS
    assert Counter(n.target for n in _collectives(bwd))[c10d.reduce_scatter_tensor.default] == N_LAYERS
    for gm in (fwd, bwd):
        _check_order(gm)
        for c in _collectives(gm):
            assert c.meta["val"].dtype == c.args[0].meta["val"].dtype
            if c.target is c10d.all_gather_into_tensor.default and BUCKET_META_KEY in c.meta:
                copy_in = c.args[0]
                assert copy_in.target is torch.ops.fsdp_passes.copy_in_members.default
                # the copy-in reads the bf16 casts of the fp32 shards
                assert all(m.target is torch.ops.prims.convert_element_type.default for m in copy_in.args[0])


def _traced(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*args)


def _annotate(gm, names):
    """Give the collectives of a hand-made graph parameter FQNs, as simple_fsdp does."""
    for c, name in zip(_collectives(gm), names):
        c.meta["custom"] = {"fsdp_param": name}
        next(iter(c.users)).meta["custom"] = {"fsdp_param": name}


def test_one_bucket_per_dtype_within_an_entry():
    def f(a, b, c, x):
        wa = c10d.wait_tensor(c10d.all_gather_into_tensor(a.to(torch.bfloat16), 2, "0"))
        wb = c10d.wait_tensor(c10d.all_gather_into_tensor(b, 2, "0"))
        wc = c10d.wait_tensor(c10d.all_gather_into_tensor(c.to(torch.bfloat16), 2, "0"))
        return (x.to(torch.bfloat16) @ wa.t()).float() @ wb.t() + (x.to(torch.bfloat16) @ wc.t()).float().sum()

    gm = _traced(f, torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8), torch.randn(3, 8))
    _annotate(gm, ["blk.a", "blk.b", "blk.c"])
    r = bucket_graph(gm, Options(bucketing="manual", bucket_plan=["blk"], memory_budget="1GB"))
    assert sorted((len(b), b.dtype, b.close_reason) for b in r.buckets) == [
        (1, "float32", "dtype"), (2, "bfloat16", "dtype")]
    assert r.n_collectives_after == 2
    _check_order(gm)


# -- errors, dependencies, cycles --------------------------------------------------------------------------------

def test_unmatched_plan_entry(mlp_graphs):
    gm = _copy(mlp_graphs[0])
    code = gm.code
    with pytest.raises(ValueError, match="'decoder'") as info:
        bucket_graph(gm, Options(bucketing="manual", bucket_plan=PER_LAYER_PLAN + ["decoder"], strict=True,
                                  memory_budget="1GB"))
    assert isinstance(info.value, UnmatchedPlanEntry) and info.value.entries == ["decoder"]
    assert gm.code == code  # nothing touched
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = bucket_graph(gm, Options(bucketing="manual", bucket_plan=PER_LAYER_PLAN + ["decoder"], memory_budget="1GB"))
    assert r.unmatched_entries == ["decoder"] and any("decoder" in str(w.message) for w in caught)
    assert r.n_collectives_after == N_LAYERS


def test_dependent_members_are_never_merged():
    def f(a, x):
        w1 = c10d.wait_tensor(c10d.all_gather_into_tensor(a, 2, "0"))
        w2 = c10d.wait_tensor(c10d.all_gather_into_tensor(w1[:2] * 2, 2, "0"))
        return x @ w1.t(), x @ w2.t()

    gm = _traced(f, torch.randn(4, 8), torch.randn(3, 8))
    _annotate(gm, ["blk.a", "blk.b"])
    dag = dag_from_fx(gm.graph)
    plan = plan_manual(dag, ["blk"], bucket_non_fsdp=True)
    assert [len(b) for b in plan.buckets] == [1, 1] and plan.buckets[0].close_reason == "dependency"
    auto = plan_auto(dag, _UnitCost(), bucket_non_fsdp=True)
    assert [len(b) for b in auto.buckets] == [1, 1] and auto.buckets[0].close_reason == "dependency"
    forced = make_bucket(dag, dag.collectives(), close_reason="plan")
    assert plan_cycles(dag, [forced]) == [0]
    with pytest.raises(ValueError, match="cycle"):
        apply_buckets(gm, dag, [forced])


def test_non_fsdp_collectives_need_the_option():
    def f(x, g):
        y = c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", "0"))
        z = c10d.wait_tensor(c10d.all_reduce(g * 3, "sum", "0"))
        return y + 1, z + 1

    gm = _traced(f, torch.randn(4, 8), torch.randn(6))
    dag = dag_from_fx(gm.graph)
    plan = plan_auto(dag, _UnitCost())
    assert not plan.buckets and all("bucket_non_fsdp" in why for why in plan.unbucketed.values())
    r = bucket_graph(gm, Options(bucketing="auto", bucket_non_fsdp=True, memory_budget="1GB"), _UnitCost())
    assert r.n_collectives_after == 1
    _check_order(gm)
    out = [a for a in gm.graph.output_node().args[0]]
    assert [tuple(a.meta["val"].shape) for a in out] == [(4, 8), (6,)]


class _UnitCost:
    """alpha = 1 ms, beta = 1 ms per MB: merging always saves latency."""

    def collective_ms(self, op, nbytes, group_size, group_ranks=None):
        return 1.0 + nbytes / 1e6

    def estimate(self, dag):
        return [0.0 if n.kind is not NodeKind.COMPUTE else 0.01 for n in dag.nodes]

    def compute_ms(self, flops, bytes_moved, dtype=None):
        return 0.01

    def overlap_costs(self):
        return OverlapCosts()  # overlapping is free


# -- scale -------------------------------------------------------------------------------------------------------

def _synthetic_dag(n_layers: int, per_layer_compute: int = 20, params: int = 4) -> Dag:
    """Forward-like chain: per layer ``params`` x (cast -> all-gather -> wait) then compute using them."""
    nodes: list[DagNode] = []
    edges: list[tuple[int, int]] = []
    prev = None
    for layer in range(n_layers):
        waits = []
        for p in range(params):
            cast = len(nodes)
            nodes.append(DagNode(name=f"cast_{layer}_{p}", kind=NodeKind.COMPUTE, op="prims.convert_element_type.default",
                                 out_bytes=1 << 16))
            ag = len(nodes)
            nodes.append(DagNode(name=f"ag_{layer}_{p}", kind=NodeKind.COLLECTIVE, collective=CollectiveOp.ALL_GATHER,
                                 op="_c10d_functional.all_gather_into_tensor.default", group_name="0", group_size=8,
                                 comm_bytes=1 << 19, dtype="bfloat16", fsdp=True))
            edges.append((cast, ag))
            w = len(nodes)
            nodes.append(DagNode(name=f"wait_{layer}_{p}", kind=NodeKind.WAIT, op="_c10d_functional.wait_tensor.default",
                                 collective_of=ag, alias_of=ag))
            edges.append((ag, w))
            waits.append(w)
        for k in range(per_layer_compute):
            i = len(nodes)
            nodes.append(DagNode(name=f"mm_{layer}_{k}", kind=NodeKind.COMPUTE, op="aten.mm.default", flops=1e9,
                                 out_bytes=1 << 16))
            if prev is not None:
                edges.append((prev, i))
            if k < params:
                edges.append((waits[k], i))
            prev = i
    return Dag(nodes, edges)


def test_plan_auto_on_100k_nodes():
    # its time is a target of benchmarks/pass_scaling.py, not of this test
    from fsdp_passes.cost_model import CostModel

    dag = _synthetic_dag(n_layers=3600)  # 3600 * (4 * 3 + 20) = 115200 nodes, 14400 all-gathers
    assert len(dag) > 100_000
    cm = CostModel.from_options("h100-nvlink")
    plan = plan_auto(dag, cm, bucket_cap_mb=64, extra_bytes_limit=1 << 30)
    assert not plan_cycles(dag, plan.buckets)
    assert plan.n_collectives_after < plan.n_collectives_before


def test_a_collective_survey_is_checked_against_its_dag_and_option(mlp_graphs):
    from fsdp_passes.bucketing.plan import survey_collectives
    from fsdp_passes.pipeline import plan_bucketing

    fwd, bwd = (dag_from_fx(g.graph) for g in mlp_graphs[:2])
    survey = survey_collectives(fwd)
    options = Options(bucketing="auto", memory_budget="1GB", cluster="cpu-gloo")
    # the plan made with the survey is the plan made without it (computed independently)
    assert plan_bucketing(fwd, options, survey=survey).buckets == plan_bucketing(fwd, options).buckets
    with pytest.raises(ValueError, match="survey: taken of another DAG or with another bucket_non_fsdp"):
        plan_bucketing(bwd, options, survey=survey)
    with pytest.raises(ValueError, match="survey: taken of another DAG or with another bucket_non_fsdp"):
        plan_bucketing(fwd, options.replace(bucket_non_fsdp=True), survey=survey)


def test_merged_reduction_goes_before_a_collective_that_reads_one_of_its_members():
    """A merged reduction takes its last member's place in its group's sequence unless a collective placed
    before that reads one of its members' results: then it goes first (one sequence on every rank, and no
    cycle).  Sequence ``ar1, ag2(ar1), ar3``; bucket ``{ar1, ar3}``: ``ar(1+3), ag2``."""
    def f(x, g, a):
        r1 = c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", "0"))
        w2 = c10d.wait_tensor(c10d.all_gather_into_tensor(a + r1[:4, :1], 2, "0"))
        r3 = c10d.wait_tensor(c10d.all_reduce(g * 3, "sum", "0"))
        return r1 + 1, w2.sum(), r3 + 1

    gm = _traced(f, torch.randn(4, 8), torch.randn(6), torch.randn(4, 8))
    dag = dag_from_fx(gm.graph)
    ars = [c for c in dag.collectives() if dag.nodes[c].collective is CollectiveOp.ALL_REDUCE]
    apply_buckets(gm, dag, [make_bucket(dag, ars, close_reason="plan")])
    _check_order(gm)
    ops = [str(n.target).split(".")[1] for n in _collectives(gm)]
    assert ops == ["all_reduce", "all_gather_into_tensor"]
