"""Cost model: profiles, α–β collectives, roofline, FLOPs, calibration tables, CostModel."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_passes.cost_model import (
    Calibration,
    ClusterProfile,
    CostModel,
    available_profiles,
    collective_ms,
    compute_ms,
    estimate_collective,
    group_topology,
    load_profile,
    profile_from_mapping,
    shapes_key,
)
from fsdp_passes.dag.flops import aten_flops
from fsdp_passes.dag.graph import CollectiveOp, Dag, DagNode, NodeKind

AG, RS, AR, A2A = (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE,
                   CollectiveOp.ALL_TO_ALL)
GiB = 1 << 30

# A small profile with round numbers; LL disabled so only the Simple protocol is priced.
SMALL = dict(
    name="small",
    gpus_per_node=4,
    intra_node_bw_gbps=100.0,
    inter_node_bw_per_nic_gbps=10.0,
    nics_per_node=2,
    ring_base_latency_simple_us=10.0,
    ring_base_latency_ll_us=5.0,
    tree_base_latency_simple_us=20.0,
    tree_base_latency_ll_us=5.0,
    intra_hop_latency_simple_us=1.0,
    intra_hop_latency_ll_us=0.5,
    inter_hop_latency_simple_us=5.0,
    inter_hop_latency_ll_us=2.0,
    ll_bandwidth_fraction=0.0,
    tree_bandwidth_fraction=0.5,
    tflops_float32=10.0,
    tflops_bfloat16=100.0,
    tflops_float16=50.0,
    mem_bw_gbps=1000.0,
    kernel_launch_us=5.0,
)


@pytest.fixture
def small() -> ClusterProfile:
    return profile_from_mapping(SMALL)


# -- profiles ------------------------------------------------------------------------------------------------


def test_shipped_profiles():
    assert available_profiles() == sorted(["a100", "cpu-gloo", "h100-nvlink", "h200"])
    for name in available_profiles():
        p = load_profile(name)
        assert p.name == name and p.description
        assert profile_from_mapping(p.to_dict()) == p
    h100 = load_profile("h100-nvlink")
    assert h100.gpus_per_node == 8 and h100.nics_per_node == 8
    assert load_profile(h100) is h100


def test_unknown_profile_lists_available():
    with pytest.raises(ValueError) as exc:
        load_profile("tpu-v9")
    for name in available_profiles():
        assert name in str(exc.value)


def test_profile_mapping_with_base_overrides():
    p = profile_from_mapping({"base": "h100-nvlink", "inter_node_bw_per_nic_gbps": 12, "nics_per_node": 4})
    base = load_profile("h100-nvlink")
    assert p.inter_node_bw_per_nic_gbps == 12.0 and p.nics_per_node == 4
    assert p.intra_node_bw_gbps == base.intra_node_bw_gbps
    assert p.name == "h100-nvlink+custom"
    assert profile_from_mapping({"base": "a100", "name": "mine"}).name == "mine"


@pytest.mark.parametrize(
    "mapping, words",
    [
        ({"base": "h100-nvlink", "intra_node_bw_gbps": -1}, ["intra_node_bw_gbps", "positive"]),
        ({"base": "h100-nvlink", "gpus_per_node": 2.5}, ["gpus_per_node", "integer"]),
        ({"base": "h100-nvlink", "ll_bandwidth_fraction": 2}, ["ll_bandwidth_fraction", "[0, 1]"]),
        ({"base": "h100-nvlink", "collective_floor_us": -1}, ["collective_floor_us", "non-negative"]),
        ({"base": "h100-nvlink", "nvlink_gen": 4}, ["nvlink_gen", "expected fields"]),
        ({"base": "nope"}, ["nope", "h100-nvlink"]),
        ({"base": "h100-nvlink", "mem_bw_gbps": "fast"}, ["mem_bw_gbps", "number"]),
        ({"gpus_per_node": 8}, ["missing", "intra_node_bw_gbps"]),
    ],
)
def test_profile_mapping_errors(mapping, words):
    with pytest.raises(ValueError) as exc:
        profile_from_mapping(mapping)
    for w in words:
        assert w in str(exc.value)


def test_options_accept_profiles():
    from fsdp_passes.options import Options

    assert Options(cluster="cpu-gloo").cluster == "cpu-gloo"
    Options(cluster={"base": "a100", "nics_per_node": 4})
    with pytest.raises(ValueError, match="cluster"):
        Options(cluster="nope")


# -- collectives: exact arithmetic ------------------------------------------------------------------------------


def test_all_gather_reduce_scatter_hand_computed(small):
    # 4 ranks in one node: latency 10 + 3*1 = 13 us; bytes 4e6*(3/4) = 3e6 over 100 GB/s = 0.03 ms
    for op in (AG, RS):
        assert collective_ms(op, 4_000_000, 4, small) == pytest.approx(0.013 + 0.03, rel=1e-12)
    # 8 contiguous ranks = 2 nodes of 4: ring steps 7, one of them inter-node: 10 + 6*1 + 1*5 = 21 us;
    # busbw = min(100, 2 NICs * 10) = 20 GB/s; 8e6 * 7/8 / 20e9 s = 0.35 ms
    assert collective_ms(AG, 8_000_000, 8, small) == pytest.approx(0.021 + 0.35, rel=1e-12)


def test_all_reduce_ring_vs_tree_hand_computed(small):
    # one node, 4 ranks: ring 10 + 6*1 = 16 us + 2*4e6*3/4/100e9 = 0.06 ms -> 0.076
    # tree: 20 + 2*(3*1) = 26 us + 2*4e6/(0.5*100e9) = 0.16 ms -> 0.186; ring wins
    e = estimate_collective(AR, 4_000_000, 4, small)
    assert (e.algorithm, e.protocol) == ("ring", "simple")
    assert e.ms == pytest.approx(0.016 + 0.06, rel=1e-12)
    # 64 ranks over 16 nodes, 1 KB: ring 10 + 2*(63-15)*1 + 2*15*5 = 256 us;
    # tree 20 + 2*(3*1 + 4*5) = 66 us -> tree wins small messages
    e = estimate_collective(AR, 1000, 64, small)
    assert e.algorithm == "tree"
    assert e.ms == pytest.approx(0.066 + 2 * 1000 / (0.5 * 20e9) * 1e3, rel=1e-12)
    ring = 0.256 + 2 * 1000 * 63 / 64 / 20e9 * 1e3
    assert ring > e.ms
    # large messages: ring bandwidth wins
    assert estimate_collective(AR, 1 << 30, 64, small).algorithm == "ring"


def test_ll_protocol_wins_small_messages():
    h100 = load_profile("h100-nvlink")
    small_msg = estimate_collective(AG, 4096, 8, h100)
    big_msg = estimate_collective(AG, 256 << 20, 8, h100)
    assert small_msg.protocol == "ll" and big_msg.protocol == "simple"
    # without the per-call floor: LL 6.6 + 7*0.6 = 10.8 us + 4096*7/8 over min(141, 0.5*360) GB/s
    no_floor = h100.replace(collective_floor_us=0.0)
    e = estimate_collective(AG, 4096, 8, no_floor)
    assert (e.protocol, e.bus_bw_gbps) == ("ll", 141.0)
    assert e.ms == pytest.approx(0.0108 + 4096 * 7 / 8 / 141e9 * 1e3, rel=1e-12)
    # the floor: a call takes at least collective_floor_us (45 us), whatever the protocol's latency
    assert small_msg.ms == pytest.approx(0.045, rel=1e-12)
    assert big_msg.ms == collective_ms(AG, 256 << 20, 8, no_floor) > 0.045


def test_ll_bandwidth_cap_and_network_overhead_across_nodes(small):
    p = profile_from_mapping(dict(SMALL, ll_bandwidth_fraction=0.5, ll_max_bw_intra_gbps=30.0,
                                  ll_max_bw_inter_gbps=4.0, net_overhead_us=2.0))
    # one node: LL bus bandwidth min(30, 0.5*100); latency 5 + 3*0.5
    e = estimate_collective(AG, 4000, 4, p)
    assert (e.protocol, e.bus_bw_gbps, e.latency_us) == ("ll", 30.0, 6.5)
    # two nodes of 4 (2 NICs each, 20 GB/s): LL min(4, 0.5*20); 6 intra steps at max(0.5, 2) + 1 network step
    e = estimate_collective(AG, 800, 8, p)
    assert (e.protocol, e.bus_bw_gbps) == ("ll", 4.0)
    assert e.latency_us == pytest.approx(5 + 6 * 2 + 2)
    # Simple posts three times per step: max(1, 3*2) per intra step
    s = estimate_collective(AG, 1 << 30, 8, p)
    assert (s.protocol, s.latency_us) == ("simple", pytest.approx(10 + 6 * 6 + 5))


def test_floors(small):
    p = profile_from_mapping(dict(SMALL, collective_floor_us=30.0, inter_node_latency_floor_us=40.0))
    # one node: 10 + 3*1 = 13 us latency; the call floor hides the transfer until latency + transfer > 30 us
    assert collective_ms(AG, 4000, 4, p) == pytest.approx(0.030, rel=1e-12)
    big = 4_000_000
    assert collective_ms(AG, big, 4, p) == pytest.approx(0.013 + big * 3 / 4 / 100e9 * 1e3, rel=1e-12)
    # two nodes: latency 10 + 6*1 + 5 = 21 us is raised to 40 us and the transfer adds to it
    e = estimate_collective(AG, 8000, 8, p)
    assert e.latency_us == 40.0
    assert e.ms == pytest.approx(0.040 + 8000 * 7 / 8 / 20e9 * 1e3, rel=1e-12)
    # a group inside one node does not pay the network's floor
    assert estimate_collective(AG, big, 4, p).latency_us == 13.0


def test_group_size_one_and_zero_bytes_cost_nothing(small):
    for op in (AG, RS, AR, A2A):
        assert collective_ms(op, 1 << 20, 1, small) == 0.0
        assert collective_ms(op, 0, 8, small) == 0.0
    assert collective_ms(CollectiveOp.OTHER, 0, 8, small) > 0  # a barrier still costs latency


def test_strided_groups_are_inter_node(small):
    # 4 ranks, stride 4 (one per node over 4 nodes): every hop is inter-node, 1 NIC each
    topo = group_topology(small, 4, (0, 4, 8, 12))
    assert (topo.nodes, topo.max_ranks_per_node, topo.min_nics_per_node) == (4, 1, 1)
    e = estimate_collective(AG, 4_000_000, 4, small, (0, 4, 8, 12))
    assert e.latency_us == pytest.approx(10 + 3 * 5)
    assert e.ms == pytest.approx(0.025 + 3_000_000 / 10e9 * 1e3, rel=1e-12)
    # the same 4 ranks contiguous stay on NVLink
    assert collective_ms(AG, 4_000_000, 4, small, (0, 1, 2, 3)) == collective_ms(AG, 4_000_000, 4, small)
    assert collective_ms(AG, 4_000_000, 4, small, (0, 1, 2, 3)) < e.ms


def test_all_to_all_model(small):
    # one node: 10 + 1 us, bytes 4e6*3/4 over 100 GB/s
    assert collective_ms(A2A, 4_000_000, 4, small) == pytest.approx(0.011 + 0.03, rel=1e-12)
    # 2 nodes of 4: 10+1+5 us; NVLink share 8e6*3/8/100e9; network share 8e6*4/8 over 20 GB/s / 4 ranks
    t = 0.016 + max(8e6 * 3 / 8 / 100e9, 8e6 * 4 / 8 / 5e9) * 1e3
    assert collective_ms(A2A, 8_000_000, 8, small) == pytest.approx(t, rel=1e-12)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(op="gather", nbytes=1, group_size=2), "op"),
        (dict(op=AG, nbytes=-1, group_size=2), "nbytes"),
        (dict(op=AG, nbytes=1, group_size=0), "group_size"),
        (dict(op=AG, nbytes=1, group_size=2, group_ranks=(0,)), "group_ranks"),
        (dict(op=AG, nbytes=1, group_size=2, group_ranks=(1, 1)), "group_ranks"),
    ],
)
def test_collective_bad_input(small, kwargs, word):
    with pytest.raises(ValueError, match=word):
        estimate_collective(profile=small, **kwargs)


# -- collectives: reproduce nccl-tests --------------------------------------------------------------------------


def _busbw_gbps(op, nbytes, n, profile, ranks=None):
    t_s = collective_ms(op, nbytes, n, profile, ranks) / 1e3
    factor = 2 if op is AR else 1
    return nbytes / t_s * factor * (n - 1) / n / 1e9


# the h100-nvlink busbw checks against published numbers: tests/test_cost_model_published.py


def test_a100_slower_than_h100():
    a100, h100 = load_profile("a100"), load_profile("h100-nvlink")
    assert collective_ms(AG, GiB, 8, a100) > collective_ms(AG, GiB, 8, h100)
    assert _busbw_gbps(AG, GiB, 8, a100) == pytest.approx(230, rel=0.15)


# -- collectives: properties ----------------------------------------------------------------------------------

_profiles = st.sampled_from(available_profiles() + ["small"])


def _get(name):
    return profile_from_mapping(SMALL) if name == "small" else load_profile(name)


@settings(max_examples=200, deadline=None)
@given(
    name=_profiles,
    op=st.sampled_from(list(CollectiveOp)),
    n=st.integers(1, 1024),
    a=st.integers(0, 1 << 34),
    b=st.integers(0, 1 << 34),
)
def test_more_bytes_never_faster(name, op, n, a, b):
    p = _get(name)
    lo, hi = sorted((a, b))
    assert collective_ms(op, lo, n, p) <= collective_ms(op, hi, n, p)


@settings(max_examples=200, deadline=None)
@given(name=_profiles, op=st.sampled_from([AG, RS, AR]), a=st.integers(1, 4096), b=st.integers(1, 4096))
def test_more_ranks_on_a_ring_never_less_latency(name, op, a, b):
    p = _get(name)
    lo, hi = sorted((a, b))
    assert estimate_collective(op, 1, lo, p).latency_us <= estimate_collective(op, 1, hi, p).latency_us


@settings(max_examples=200, deadline=None)
@given(
    name=_profiles,
    op=st.sampled_from([AG, RS, AR]),
    a=st.integers(1, 256),
    b=st.integers(1, 256),
    nbytes=st.integers(0, 1 << 32),
)
def test_more_ranks_on_a_ring_never_less_time(name, op, a, b, nbytes):
    # group sizes that fill their nodes evenly (part of one node, or whole nodes); a partly filled last node
    # can legitimately be slower than a full one (fewer NICs in reach), see collectives.py
    p = _get(name)
    gpn = p.gpus_per_node
    lo, hi = sorted(n if n <= gpn else gpn * math.ceil(n / gpn) for n in (a, b))
    assert collective_ms(op, nbytes, lo, p) <= collective_ms(op, nbytes, hi, p) * (1 + 1e-12)


@settings(max_examples=100, deadline=None)
@given(name=_profiles, n=st.integers(2, 512), nbytes=st.integers(1, 1 << 32))
def test_all_reduce_costs_about_ag_plus_rs(name, n, nbytes):
    p = _get(name)
    ar = collective_ms(AR, nbytes, n, p)
    assert ar <= collective_ms(AG, nbytes, n, p) + collective_ms(RS, nbytes, n, p) + 1e-12


# -- roofline and FLOPs ---------------------------------------------------------------------------------------


def test_roofline_hand_computed(small):
    # compute bound: 1e12 flops at 10 TFLOP/s = 100 ms, plus 5 us
    assert compute_ms(1e12, 1e6, "float32", small) == pytest.approx(100.005)
    # memory bound: 1e9 bytes at 1000 GB/s = 1 ms
    assert compute_ms(1e6, 1e9, torch.bfloat16, small) == pytest.approx(1.005)
    assert compute_ms(1e12, 0, "bf16", small) == pytest.approx(10.005)
    assert compute_ms(1e12, 0, "torch.float16", small) == pytest.approx(20.005)
    assert compute_ms(1e12, 0, None, small) == pytest.approx(100.005)
    with pytest.raises(ValueError, match="dtype"):
        compute_ms(1, 1, "banana", small)
    with pytest.raises(ValueError, match="flops"):
        compute_ms(-1, 1, None, small)


def test_mm_flops_on_fake_tensors_and_roofline(small):
    from torch._subclasses.fake_tensor import FakeTensorMode

    M, K, N = 256, 512, 128
    with FakeTensorMode():
        a = torch.empty(M, K)
        b = torch.empty(K, N)
        out = a @ b
    flops = aten_flops(torch.ops.aten.mm.default, (a, b), {}, out)
    assert flops == 2 * M * N * K
    moved = (M * K + K * N + M * N) * 4
    model = CostModel(small)
    assert model.compute_ms(flops, moved, "float32") == pytest.approx(
        small.kernel_launch_us / 1e3 + max(flops / 10e12, moved / 1000e9) * 1e3
    )


def test_flops_on_fx_graph_meta_and_shape_objects():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, bias, q, k, v):
        return torch.addmm(bias, x, w), torch.bmm(q, k), torch.nn.functional.relu(v)

    args = (torch.randn(8, 16), torch.randn(16, 4), torch.randn(4), torch.randn(2, 3, 5), torch.randn(2, 5, 7),
            torch.randn(3))
    gm = make_fx(f, tracing_mode="fake")(*args)
    counts = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            counts[str(node.target)] = aten_flops(node.target, node.args, node.kwargs, node.meta["val"])
    assert counts["aten.addmm.default"] == 2 * 8 * 16 * 4
    assert counts["aten.bmm.default"] == 2 * 2 * 3 * 5 * 7
    assert counts["aten.relu.default"] == 0.0

    class Shaped:
        def __init__(self, *shape):
            self.shape = shape

    assert aten_flops("aten.mm.default", (Shaped(3, 4), Shaped(4, 5)), {}, Shaped(3, 5)) == 2 * 3 * 4 * 5
    assert aten_flops("aten::no_such_op", (), {}, None) == 0.0
    assert aten_flops(None) == 0.0


def test_flops_attention_and_backward_ops():
    q = torch.empty(2, 4, 16, 8, device="meta")
    fwd = aten_flops(torch.ops.aten._scaled_dot_product_flash_attention.default, (q, q, q), {}, None)
    assert fwd == 2 * (2 * 2 * 4 * 16 * 16 * 8)  # QK^T and PV
    g = q
    bwd = aten_flops(torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
                     (g, q, q, q, None, q, q, None, None, 0.0, (True, True, True, False)), {}, None)
    assert bwd > fwd
    x = torch.empty(1, 3, 8, 8, device="meta")
    w = torch.empty(6, 3, 3, 3, device="meta")
    out = torch.empty(1, 6, 6, 6, device="meta")
    conv = aten_flops(torch.ops.aten.convolution.default,
                      (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}, out)
    assert conv == 2 * 6 * 6 * 6 * 3 * 3 * 3


# -- calibration tables ----------------------------------------------------------------------------------------


def _table() -> Calibration:
    cal = Calibration()
    for nbytes, ms in [(1024, 0.1), (4096, 0.2), (1 << 20, 2.0), (1 << 22, 6.0)]:
        cal.add_collective(AG, 2, nbytes, ms)
    cal.add_collective("reduce_scatter", 2, 4096, 0.3)
    cal.add_compute("aten.mm.default", "float32[4,4];float32[4,4]", 0.5)
    cal.add_compute("aten.addmm.default", "*", 0.7)
    return cal


def test_calibration_exact_at_measured_points():
    cal = _table()
    for nbytes, ms in cal.points(AG, 2):
        assert cal.collective_ms(AG, nbytes, 2) == ms
        assert cal.collective_ms("all_gather", nbytes, 2) == ms


def test_calibration_log_log_interpolation():
    cal = _table()
    # geometric midpoint of 1024 and 4096 -> geometric mean of 0.1 and 0.2
    assert cal.collective_ms(AG, 2048, 2) == pytest.approx(math.sqrt(0.1 * 0.2), rel=1e-12)
    x = 100_000
    w = (math.log(x) - math.log(4096)) / (math.log(1 << 20) - math.log(4096))
    assert cal.collective_ms(AG, x, 2) == pytest.approx(0.2 * (2.0 / 0.2) ** w, rel=1e-12)


def test_calibration_extrapolation_and_gaps():
    cal = _table()
    # above: alpha-beta line through the last two points
    slope = (6.0 - 2.0) / ((1 << 22) - (1 << 20))
    assert cal.collective_ms(AG, 1 << 24, 2) == pytest.approx(6.0 + slope * ((1 << 24) - (1 << 22)))
    # below: line through the first two points, never under t0*x/x0
    s0 = (0.2 - 0.1) / (4096 - 1024)
    assert cal.collective_ms(AG, 512, 2) == pytest.approx(0.1 - s0 * 512)
    assert cal.collective_ms(AG, 1, 2) > 0
    # fewer than two points: only exact sizes; unknown group size / op: None
    assert cal.collective_ms(RS, 4096, 2) == 0.3
    assert cal.collective_ms(RS, 8192, 2) is None
    assert cal.collective_ms(AG, 4096, 4) is None
    assert cal.collective_ms(AR, 4096, 2) is None
    # compute entries: exact shapes or the "*" entry
    assert cal.compute_ms("aten.mm.default", "float32[4,4];float32[4,4]") == 0.5
    assert cal.compute_ms("aten.mm.default", "float32[8,8];float32[8,8]") is None
    assert cal.compute_ms("aten.addmm.default", "anything") == 0.7


def test_calibration_round_trip(tmp_path):
    cal = _table()
    path = tmp_path / "cal.json"
    cal.save(path)
    again = Calibration.load(path)
    assert again == cal and again.digest() == cal.digest()
    assert json.loads(path.read_text())["format"] == "fsdp_passes.calibration"


@pytest.mark.parametrize(
    "content, words",
    [
        ("{not json", ["not valid JSON"]),
        ("[1, 2]", ["top level"]),
        ('{"collectives": {"a": 1}}', ["collectives", "list"]),
        ('{"collectives": [{"op": "all_gather", "group_size": 2}]}', ["collectives[0]", "points"]),
        ('{"collectives": [{"op": "all_gather", "group_size": 2, "points": [[1024, -1]]}]}',
         ["collectives[0].points[0]", "ms"]),
        ('{"collectives": [{"op": "all_gather", "group_size": 2, "points": [[0, 1.0]]}]}', ["bytes"]),
        ('{"collectives": [{"op": "all_gather", "group_size": 0, "points": [[8, 1.0]]}]}', ["group_size"]),
        ('{"compute": [{"op": "aten.mm.default", "ms": 1}]}', ["compute[0]", "shapes"]),
        ('{"version": 99}', ["version"]),
    ],
)
def test_corrupt_calibration_file(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError) as exc:
        Calibration.load(path)
    assert str(path) in str(exc.value)
    for w in words:
        assert w in str(exc.value)


def test_missing_calibration_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        Calibration.load(tmp_path / "nope.json")


# -- CostModel -------------------------------------------------------------------------------------------------


def _dag() -> Dag:
    nodes = [
        DagNode("ag", NodeKind.COLLECTIVE, op="_c10d_functional.all_gather_into_tensor.default",
                collective=AG, group_name="0", group_size=4, comm_bytes=4_000_000),
        DagNode("wait", NodeKind.WAIT, op="_c10d_functional.wait_tensor.default", collective_of=0),
        DagNode("mm", NodeKind.COMPUTE, op="aten.mm.default", flops=1e12, in_bytes=600_000, out_bytes=400_000,
                dtype="float32"),
        DagNode("view", NodeKind.COMPUTE, op="aten.view.default"),
        DagNode("addmm", NodeKind.COMPUTE, op="aten.addmm.default", flops=1e9, in_bytes=10, out_bytes=10,
                dtype="bfloat16"),
        DagNode("ar", NodeKind.COLLECTIVE, collective=AR, group_name="0", group_size=8,
                group_ranks=tuple(range(0, 32, 4)), comm_bytes=1_000_000),
    ]
    return Dag(nodes, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)])


def test_cost_model_node_ms_and_estimate(small):
    model = CostModel(small)
    dag = _dag()
    est = model.estimate(dag)
    assert len(est) == len(dag)
    assert est[0] == pytest.approx(0.013 + 0.03)
    assert est[1] == 0.0  # wait
    assert est[2] == pytest.approx(0.005 + 100.0)
    assert est[3] == 0.0  # a view runs no kernel
    assert est[4] == pytest.approx(0.005 + 1e9 / 100e12 * 1e3)
    assert est[5] == collective_ms(AR, 1_000_000, 8, small, tuple(range(0, 32, 4)))
    assert model.estimate(dag) == est  # deterministic
    assert model.estimate(dag.nodes) == est


def test_cost_model_calibration_overrides(small):
    cal = Calibration()
    cal.add_collective(AG, 4, 1_000_000, 1.0)
    cal.add_collective(AG, 4, 16_000_000, 4.0)
    cal.add_compute("aten.addmm.default", "*", 0.25)
    model = CostModel(small, cal)
    est = model.estimate(_dag())
    assert est[0] == pytest.approx(math.exp(math.log(1.0) + 0.5 * math.log(4.0)))  # 4e6 is the log-midpoint
    assert est[2] == pytest.approx(0.005 + 100.0)  # no mm entry: roofline
    assert est[4] == 0.25
    assert est[5] == collective_ms(AR, 1_000_000, 8, small, tuple(range(0, 32, 4)))  # no AR data: analytic
    assert model.collective_ms(AG, 1_000_000, 1) == 0.0


def test_cost_model_compute_calibration_by_fx_shapes(small):
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda a, b: a @ b, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4))
    mm = next(n for n in gm.graph.nodes if n.op == "call_function")
    key = shapes_key([a.meta["val"] for a in mm.args])
    assert key == "float32[4,4];float32[4,4]"
    model = CostModel(small, _table())
    node = DagNode("mm", NodeKind.COMPUTE, op="aten.mm.default", flops=128, in_bytes=128, out_bytes=64,
                   origin=mm)
    assert model.node_ms(node) == 0.5


def test_cost_model_from_options(tmp_path):
    path = tmp_path / "cal.json"
    _table().save(path)
    model = CostModel.from_options("cpu-gloo", str(path))
    assert model.profile.name == "cpu-gloo" and model.calibration == _table()
    assert CostModel.from_options({"base": "a100", "nics_per_node": 1}).profile.nics_per_node == 1
    assert CostModel.from_options().profile.name == "h100-nvlink"
    assert model.key() == CostModel.from_options("cpu-gloo", str(path)).key()
    with pytest.raises(ValueError, match="calibration file"):
        CostModel.from_options("cpu-gloo", str(tmp_path / "missing.json"))


def test_cost_model_bad_nodes(small):
    model = CostModel(small)
    with pytest.raises(ValueError, match="group_size"):
        model.node_ms(DagNode("c", NodeKind.COLLECTIVE, collective=AG, comm_bytes=10))
    with pytest.raises(ValueError, match="collective"):
        model.node_ms(DagNode("c", NodeKind.COLLECTIVE, group_size=2, comm_bytes=10))
    with pytest.raises(ValueError, match="profile"):
        CostModel("h100-nvlink")  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [0, 63])
def test_a_dp8_by_tp8_mesh_prices_tp_on_nvlink_and_dp_on_the_network(fake_pg_factory, rank):
    """World 64 on nodes of 8 (h100-nvlink), a ``(dp 8, tp 8)`` mesh with tp innermost: the ranks the DAG builder
    reads off each group (``fill_collective``) put the tp group inside one node and the dp group one rank per
    node, so the same 1 GiB all-gather is priced on NVLink for tp and on one NIC per node for dp.  Expected
    times are the ring's α–β formula (field notes §5) with the profile's Simple-protocol numbers, by hand."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_passes.dag.ops import fill_collective

    fake_pg_factory(64, rank)
    mesh = init_device_mesh("cpu", (8, 8), mesh_dim_names=("dp", "tp"))
    h100 = load_profile("h100-nvlink")
    assert (h100.gpus_per_node, h100.nics_per_node) == (8, 8)
    node_of_rank = rank // 8
    nbytes, n = GiB, 8
    priced = {}
    for dim, expected_ranks in (("dp", tuple(range(rank % 8, 64, 8))), ("tp", tuple(range(8 * node_of_rank,
                                                                                             8 * node_of_rank + 8)))):
        node = DagNode(f"ag_{dim}", NodeKind.COLLECTIVE, collective=AG)
        fill_collective(node, AG, (n, mesh[dim].get_group().group_name), nbytes // n, nbytes)
        assert node.group_ranks == expected_ranks and node.comm_bytes == nbytes
        priced[dim] = CostModel(h100).estimate([node])[0]
    # tp: 7 ring steps, all over NVLink, at the node's bus bandwidth
    tp_latency_us = h100.ring_base_latency_simple_us + 7 * h100.intra_hop_latency_simple_us
    tp_ms = tp_latency_us / 1e3 + nbytes * 7 / 8 / (h100.intra_node_bw_gbps * 1e9) * 1e3
    # dp: 7 ring steps, every one across nodes, through the one NIC each rank's node gives a 1-rank-per-node group
    dp_latency_us = max(h100.ring_base_latency_simple_us + 7 * h100.inter_hop_latency_simple_us,
                        h100.inter_node_latency_floor_us)
    dp_ms = dp_latency_us / 1e3 + nbytes * 7 / 8 / (h100.inter_node_bw_per_nic_gbps * 1e9) * 1e3
    assert priced["tp"] == pytest.approx(tp_ms, rel=1e-12)
    assert priced["dp"] == pytest.approx(dp_ms, rel=1e-12)
    assert priced["dp"] > 7 * priced["tp"]  # 360 GB/s NVLink against one 47 GB/s NIC
