"""gloo's collectives priced by the algorithms gloo runs, against times measured on a real link.

Measured on the emulated 2-rank cluster of ``benchmarks/emulated_cluster.py`` (two network namespaces, a veth
pair capped by ``tc tbf rate 400mbit`` each way, one gloo rank per namespace), 16 MiB payloads in the cost
model's byte convention (full gathered size / full pre-scatter input / all-reduce buffer):
all-gather 0.22 s, reduce-scatter 0.36 s, all-reduce 0.35 s.
"""

from __future__ import annotations

import pytest

from fsdp_passes.cost_model import collective_ms, estimate_collective, load_profile

MIB = 2**20
MEASURED_S = {"all_gather": 0.22, "reduce_scatter": 0.36, "all_reduce": 0.35}
# the link profile emulated_cluster.py plans with: cpu-gloo with the link's 400 Mbit/s as its bandwidth
LINK = {"base": "cpu-gloo", "intra_node_bw_gbps": 0.05, "inter_node_bw_per_nic_gbps": 0.05}


def _predicted_s(profile):
    return {op: collective_ms(op, 16 * MIB, 2, profile) / 1e3 for op in MEASURED_S}


def test_gloo_reduce_scatter_costs_an_all_reduce_as_measured():
    pred = _predicted_s(load_profile(LINK))
    # reduce-scatter and all-reduce within 15 % of the measurement
    for op in ("reduce_scatter", "all_reduce"):
        assert pred[op] == pytest.approx(MEASURED_S[op], rel=0.15), (op, pred[op])
    # the measured proportion: a reduce-scatter costs what an all-reduce costs (0.36 / 0.35)
    assert pred["reduce_scatter"] / pred["all_reduce"] == pytest.approx(0.36 / 0.35, rel=0.1)
    # and clearly more than an all-gather (measured 1.64x; a ring reduce-scatter would cost 1.0x)
    assert pred["reduce_scatter"] / pred["all_gather"] > 1.5


def test_the_same_link_priced_as_nccl_would_miss_the_measurement():
    # the ring reduce-scatter NCCL runs moves half of what gloo's all-reduce-based one moves: on this link
    # that prediction is far below the measured 0.36 s (the miss the gloo model removes)
    nccl_like = load_profile({**LINK, "collective_library": "nccl"})
    rs = collective_ms("reduce_scatter", 16 * MIB, 2, nccl_like) / 1e3
    assert rs < 0.6 * MEASURED_S["reduce_scatter"]


def test_gloo_runs_only_the_ring():
    gloo = load_profile("cpu-gloo")
    for nbytes in (4096, 16 * MIB):
        for op in ("all_gather", "reduce_scatter", "all_reduce"):
            est = estimate_collective(op, nbytes, 8, gloo)
            assert (est.algorithm, est.protocol) == ("ring", "simple")
    # reduce-scatter = ring all-reduce of the same buffer, at every size and group size
    for n in (2, 4, 8, 16):
        for nbytes in (1024, MIB, 64 * MIB):
            assert collective_ms("reduce_scatter", nbytes, n, gloo) == collective_ms("all_reduce", nbytes, n, gloo)
