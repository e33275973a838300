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


# Rows that still miss by more than 15 %, with the measured ratio (model busbw / published busbw, which is
# published time / model time) and why.  A listed row must still miss with that ratio (within 0.02): when the
# model or the data change, this table and docs/design.md change with them.
KNOWN_MISSES = {
    ("h100_8gpu_reduce_scatter_sweep", 4 * 2**20): (
        1.31,
        "the published out-of-place time (59.15 us) is slower than the 8 MiB row (54.41 us) and than the same "
        "row's in-place time in the same source (46.64 us); the all-gather at 4 MiB (47.23 us) is within 5 %",
    ),
}


def _sweep_ratios(table, profile_name):
    """(size, published time / model time) for every row of a published sweep."""
    e = ENTRIES[table]
    profile = load_profile(profile_name)
    assert group_topology(profile, e["ranks"]).nodes == e["nodes"]
    return [(nbytes, time_us / (collective_ms(e["op"], nbytes, e["ranks"], profile) * 1e3))
            for nbytes, time_us, _busbw in e["rows"]]


@pytest.mark.parametrize(
    "table, profile_name",
    [
        ("h100_8gpu_all_gather_sweep", "h100-nvlink"),
        ("h100_8gpu_reduce_scatter_sweep", "h100-nvlink"),
        ("h200_2node_all_gather_sweep", "h200"),
    ],
)
def test_every_row_of_a_published_sweep_within_15_percent(table, profile_name):
    """Every row, small sizes included: model busbw within 15 % of the published busbw.  The busbw ratio is
    the inverse time ratio (busbw = S / t * (n - 1) / n); the time column is used because the busbw column
    rounds to 0.01 GB/s, two digits or fewer below 1 GB/s."""
    e = ENTRIES[table]
    ratios = _sweep_ratios(table, profile_name)
    assert len(ratios) == len(e["rows"]) and ratios[0][0] <= 2**20 and ratios[-1][0] >= 2**30
    for nbytes, ratio in ratios:
        miss = KNOWN_MISSES.get((table, nbytes))
        if miss is None:
            assert ratio == pytest.approx(1.0, rel=0.15), f"{table}: {nbytes} B, model busbw / published {ratio:.3f}"
        else:
            assert abs(ratio - 1) > 0.15 and ratio == pytest.approx(miss[0], abs=0.02), (
                f"{table}: {nbytes} B is listed as a miss ({miss[0]}) but the ratio is now {ratio:.3f}")
    # the rows are consistent with nccl-tests' own definition, busbw = S / t * (n - 1) / n
    n = e["ranks"]
    for nbytes, time_us, busbw in e["rows"]:
        if busbw >= 1:  # the table rounds to 0.01 GB/s
            assert nbytes / (time_us * 1e3) * (n - 1) / n == pytest.approx(busbw, rel=0.02)


def test_known_misses_name_rows_of_the_tables():
    for (table, nbytes), (ratio, why) in KNOWN_MISSES.items():
        assert nbytes in [row[0] for row in ENTRIES[table]["rows"]] and abs(ratio - 1) > 0.15 and why
