"""benchmarks/fidelity.py: the smoke run predicts and measures every configuration and collective size on
the emulated cluster and removes its namespaces.  Needs root, ``ip`` and ``tc`` (skipped without them, like
the emulated-cluster benchmark's runs); the one-line refusal without them is tested with the
emulated cluster's (test_benchmarks_emulated.py), whose launcher this benchmark uses.  The
benchmark's accuracy targets are reported in its JSON, not asserted here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fidelity.py"

_missing = []
if not hasattr(os, "geteuid") or os.geteuid() != 0:
    _missing.append("root")
_missing += [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
needs_netns = pytest.mark.skipif(
    bool(_missing), reason=f"the emulated cluster needs root, ip and tc; missing: {', '.join(_missing)}")


@needs_netns
def test_smoke_run_predicts_and_measures_every_configuration(tmp_path):
    out = tmp_path / "fidelity.json"
    prefix = f"fsdpfidtest{os.getpid()}"

    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--prefix", prefix],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["configs"]) == {"none", "manual", "auto", "reorder_only"}
    for name, c in data["configs"].items():
        # the same orders without the link's overlap costs: never slower
        assert 0 < c["predicted_without_overlap_costs_ms"] <= c["predicted_ms"], name
        assert len(c["measured_ms"]) == 2 and c["measured_median_ms"] > 0, name
        assert set(c["predicted_graphs_ms"]) and len(c["reports"]) == 2, name
    # the profiled step calibrated the compiled kernels; the sweep every op at both sizes
    assert data["calibration"]["kernels"] > 0
    assert {(r["op"], r["bytes"]) for r in data["collectives"]} == {
        (op, b) for op in ("all_gather", "reduce_scatter", "all_reduce") for b in (1024, 65536)}
    # predictions from bands fitted to the first sweep pass, compared with the second pass's samples
    bands = data["profile"]["small_collective_bands"]
    assert [b[0] for b in bands] == [1024, 65536] and data["profile_unfitted"]["small_collective_bands"] == []
    # and gloo's reduce-scatter priced apart from the all-reduce of its step count
    assert [op for op, _ in data["profile"]["small_collective_extra_us"]] == ["reduce_scatter"]
    for r in data["collectives"]:
        assert len(r["held_out"]["samples_ms"]) == len(r["fit_pass"]["samples_ms"]) == 4, r
        assert r["held_out"]["min_ms"] <= r["measured_ms"] <= r["held_out"]["max_ms"], r
        assert sum(m["samples"] for m in r["held_out_modes"]) <= 4, r
    assert set(data["targets"]) == {"every_configuration_within_15pct", "ranking_by_prediction_equals_measured",
                                    "auto_within_5pct_of_measured_fastest", "every_collective_within_15pct",
                                    "every_collective_within_15pct_or_its_noise"}
    out_ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in out_ns
