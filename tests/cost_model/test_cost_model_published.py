"""The GPU profiles against published NCCL bus bandwidths kept in tests/cost_model/data/published_nccl_busbw.json (each
entry names its source, date, hardware and column)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_passes.cost_model import collective_ms, group_topology, load_profile

DATA = json.loads((Path(__file__).parent / "data" / "published_nccl_busbw.json").read_text())
ENTRIES = {e["id"]: e for e in DATA["entries"]}


def _busbw_gbps(op, nbytes, n, profile, ranks=None):
    # nccl-tests' definition (PERFORMANCE.md): algbw = S / t, busbw = algbw * (n - 1) / n for AG and RS
    t_s = collective_ms(op, nbytes, n, profile, ranks) / 1e3
    return nbytes / t_s * (n - 1) / n / 1e9


def test_every_entry_names_its_source():
    for e in DATA["entries"]:
        assert e["source"] and e["hardware"] and e["column"] and e["statement"]


@pytest.mark.parametrize("nbytes", [2**30, 2**32])
def test_h100_one_node_all_gather_and_reduce_scatter_reach_the_published_plateau(nbytes):
    e = ENTRIES["h100_8gpu_nvlink_non_allreduce_plateau"]
    h100 = load_profile("h100-nvlink")
    assert nbytes >= e["min_size_bytes"]
    for op in e["ops"]:
        assert _busbw_gbps(op, nbytes, e["ranks"], h100) == pytest.approx(e["busbw_gbps"], rel=0.15), op


def test_h100_ring_over_the_network_runs_at_the_published_per_nic_rate():
    e = ENTRIES["ndr_400g_per_nic_plateau"]
    h100 = load_profile("h100-nvlink")
    lo, hi = e["busbw_gbps_per_nic_min"], e["busbw_gbps_per_nic_max"]
    # one rank per node (stride 8): the ring crosses one NDR NIC per node
    for n in (2, 8):
        ranks = tuple(range(0, 8 * n, 8))
        assert group_topology(h100, n, ranks).nodes == n
        for op in e["ops"]:
            bw = _busbw_gbps(op, e["min_size_bytes"], n, h100, ranks)
            assert lo * 0.85 <= bw <= hi * 1.15, (op, n, bw)
    # 8 full nodes: the rings cross all 8 NICs (8 x 46..48), capped by NVLink (the one-node plateau)
    plateau = ENTRIES["h100_8gpu_nvlink_non_allreduce_plateau"]["busbw_gbps"]
    bw64 = _busbw_gbps("all_gather", 8 * 2**30, 64, h100)
    assert bw64 == pytest.approx(min(plateau, 8 * (lo + hi) / 2), rel=0.15)


@pytest.mark.parametrize("table", ["h100_8gpu_all_gather_sweep", "h100_8gpu_reduce_scatter_sweep"])
def test_h100_one_node_size_sweep_in_the_bandwidth_regime(table):
    """Within 15 % of the published sweep from 8 MiB up.  Below that the published times sit on a ~45 us floor
    that NCCL's tuning-model latencies (ring LL 6.6 + 7 x 0.6 us, Simple 8.4 + 7 x 3.4 us) do not reach: the
    model is 1.1-2.2x too fast at 1-4 MiB (docs/design.md lists the misses)."""
    e = ENTRIES[table]
    h100 = load_profile("h100-nvlink")
    checked = 0
    for nbytes, _time_us, busbw in e["rows"]:
        if nbytes < 8 * 2**20:
            continue
        assert _busbw_gbps(e["op"], nbytes, e["ranks"], h100) == pytest.approx(busbw, rel=0.15), nbytes
        checked += 1
    assert checked == 11
    # the rows are consistent with nccl-tests' own definition, busbw = S / t * (n - 1) / n
    for nbytes, time_us, busbw in e["rows"]:
        assert nbytes / (time_us * 1e3) * 7 / 8 == pytest.approx(busbw, rel=0.01)


def test_h200_two_nodes_all_gather_sweep_in_the_bandwidth_regime():
    """Within 15 % of a published 2-node (16-rank) all-gather sweep from 256 MiB up.  Below, the model is
    too fast: +17-20 % at 32-128 MiB, 2-3x at <= 1 MiB, where the published times sit on a ~55 us floor
    (docs/design.md lists the misses)."""
    e = ENTRIES["h200_2node_all_gather_sweep"]
    h200 = load_profile("h200")
    assert group_topology(h200, e["ranks"]).nodes == e["nodes"]
    checked = 0
    for nbytes, _time_us, busbw in e["rows"]:
        if nbytes < 256 * 2**20:
            continue
        # nccl-tests' busbw for all-gather: S / t * (n - 1) / n with n = 16
        t_s = collective_ms(e["op"], nbytes, e["ranks"], h200) / 1e3
        assert nbytes / t_s * 15 / 16 / 1e9 == pytest.approx(busbw, rel=0.15), nbytes
        checked += 1
    assert checked == 6
    for nbytes, time_us, busbw in e["rows"]:
        if busbw >= 1:  # the table rounds to 0.01 GB/s
            assert nbytes / (time_us * 1e3) * 15 / 16 == pytest.approx(busbw, rel=0.02)
