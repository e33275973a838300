"""gloo's collectives priced by the algorithms gloo runs, against times measured on a real link.

Measured on the emulated 2-rank cluster of ``benchmarks/emulated_cluster.py`` (two network namespaces, a veth
pair capped by ``tc tbf rate 400mbit`` each way, one gloo rank per namespace): the collective sweep of the
fidelity benchmark's run 3 (``benchmarks/results/fidelity_quiet.json``, ``collectives``: medians per op and
size, in the cost model's byte convention: full gathered size / full pre-scatter input / all-reduce buffer).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_passes.cost_model import collective_ms, estimate_collective, load_profile

MIB = 2**20
SWEEP = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "fidelity_quiet.json"
# the link profile emulated_cluster.py plans with: cpu-gloo with the link's 400 Mbit/s as its bandwidth
LINK = {"base": "cpu-gloo", "intra_node_bw_gbps": 0.05, "inter_node_bw_per_nic_gbps": 0.05}


def _measured_ms() -> dict[tuple[str, int], float]:
    return {(r["op"], r["bytes"]): r["measured_ms"] for r in json.loads(SWEEP.read_text())["collectives"]}


def test_gloo_collectives_as_measured_on_the_link():
    measured = _measured_ms()
    link = load_profile(LINK)
    # from 1 MiB up the transfer dominates: every op within 15 % (all-gather with its late chunk)
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        for nbytes in (MIB, 4 * MIB, 16 * MIB, 64 * MIB):
            pred = collective_ms(op, nbytes, 2, link)
            assert pred == pytest.approx(measured[op, nbytes], rel=0.15), (op, nbytes, pred)
    # the measured proportions at 16 MiB: a reduce-scatter costs an all-reduce, and more than an all-gather
    # (a ring reduce-scatter would cost what the ring all-gather costs)
    pred = {op: collective_ms(op, 16 * MIB, 2, link) for op in ("all_gather", "reduce_scatter", "all_reduce")}
    ratio = measured["reduce_scatter", 16 * MIB] / measured["all_reduce", 16 * MIB]
    assert pred["reduce_scatter"] / pred["all_reduce"] == pytest.approx(ratio, rel=0.1)
    ratio = measured["reduce_scatter", 16 * MIB] / measured["all_gather", 16 * MIB]
    assert pred["reduce_scatter"] / pred["all_gather"] == pytest.approx(ratio, rel=0.1)


def test_a_gloo_all_gather_without_the_late_chunk_would_miss_the_measurement():
    # the ring transfer alone (8 MiB per direction at 50 MB/s) is a third below the measured 16 MiB all-gather
    ring_only = 16 * MIB / 2 / (0.05 * 1e6)
    assert ring_only < 0.7 * _measured_ms()["all_gather", 16 * MIB]


def test_the_same_link_priced_as_nccl_would_miss_the_measurement():
    # the ring reduce-scatter NCCL runs moves half of what gloo's all-reduce-based one moves: on this link
    # that prediction is far below the measured 0.36 s (the miss the gloo model removes)
    nccl_like = load_profile({**LINK, "collective_library": "nccl"})
    rs = collective_ms("reduce_scatter", 16 * MIB, 2, nccl_like)
    assert rs < 0.6 * _measured_ms()["reduce_scatter", 16 * MIB]


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
