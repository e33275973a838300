"""A pass that falls back leaves a readable record: the report counts the graph's real collectives, and with
``debug_dir`` the dump holds the unchanged schedule, its simulation and the reason, which ``report`` shows."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest

import fsdp_passes
from fsdp_passes.debug import load_dumps, parse_schedule_table, read_dag_json
from fsdp_passes.simulate import simulate
from fsdp_passes.testing import (build_mlp, capture_fx_graphs, capture_scheduler_nodes, example_inputs,
                                 inject_failure)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _collectives_in(gm) -> int:
    """Counted on the FX graph compiled without the passes: an independent count."""
    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and any(k in str(n.target) for k in names))


def test_fallback_dump_is_written_and_read_by_report(fake_pg, tmp_path):
    model = build_mlp(n_layers=2, dim=32, reshard_after_forward=True)
    inputs = example_inputs(model)
    plain = capture_fx_graphs(model, *inputs)
    expected = {"fwd": _collectives_in(plain.forward), "bwd": _collectives_in(plain.backward)}
    assert expected["fwd"] > 0 and expected["bwd"] > 0

    fsdp_passes.last_reports(clear=True)
    with inject_failure("fx"), inject_failure("scheduler"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capture_scheduler_nodes(model, *inputs, options={"debug_dir": str(tmp_path)})
    failures = [str(w.message) for w in caught if "pass failed" in str(w.message)]
    assert len(failures) == 4, failures  # fx and scheduler, forward and backward: each said once

    reports = fsdp_passes.last_reports()
    assert sorted(r.pass_name for r in reports) == ["fx", "fx", "scheduler", "scheduler"]
    for r in reports:
        kind = "bwd" if "_bwd" in r.graph else "fwd"
        assert "injected failure" in r.fallback
        # the truth about the graph left as it was, not "0 -> 0"
        assert r.n_collectives_before == r.n_collectives_after == expected[kind], r.one_line()
        assert f"collectives {expected[kind]} -> {expected[kind]}" in r.one_line()
        assert r.makespan_ms_before == r.makespan_ms_after > 0

    dumps = load_dumps(str(tmp_path))
    assert len(dumps) == 2
    for d in dumps:
        s = d.summary
        assert "injected failure in the scheduler pass" in s["fallback"]
        assert "injected failure in the fx pass" in s["fx"]["fallback"]
        dump = read_dag_json(d.file("dag.json"))
        assert dump.after == dump.before  # the unchanged schedule
        before_rows = parse_schedule_table(open(d.file("schedule_before.txt")).read())
        after_rows = parse_schedule_table(open(d.file("schedule_after.txt")).read())
        assert [r["name"] for r in after_rows] == [r["name"] for r in before_rows]
        assert len(before_rows) == len(dump.dag)
        # its simulation: what dag.json re-simulates to
        assert s["makespan_ms_before"] == pytest.approx(simulate(dump.dag, dump.before, dump.durations, dump.overlap).makespan)

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "fsdp_passes", "report", str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("2 graph(s) in")
    assert proc.stdout.count("FELL BACK (schedule unchanged): ") == 2
    assert proc.stdout.count("bucketing FELL BACK (graph unchanged): ") == 2
    assert "injected failure in the scheduler pass" in proc.stdout


def test_timeline_png_skipped_without_matplotlib_is_said_once(tmp_path, monkeypatch, caplog):
    from fsdp_passes.debug import write_scheduler_dump
    from fsdp_passes.debug.plot import matplotlib_missing_note
    from fsdp_passes.pipeline.report import GraphReport, fill_schedule_numbers
    from fsdp_passes.testing import DagBuilder

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    matplotlib_missing_note.cache_clear()
    b = DagBuilder()
    ag = b.coll("ag0", 2.0, out=1024)
    b.compute("mm0", 1.0, b.wait("ag0_wait", ag), out=64, output=True)
    dag, order = b.dag(), list(range(len(b.nodes)))
    with caplog.at_level(logging.INFO, logger="fsdp_passes"):
        for graph in ("000_fwd", "001_bwd"):
            report = GraphReport(graph=graph, pass_name="scheduler")
            timelines = fill_schedule_numbers(report, (dag, order, b.durations), (dag, order, b.durations))
            assert write_scheduler_dump(str(tmp_path), report, dag, b.durations, order, order, timelines)
    said = [r.getMessage() for r in caplog.records if "timeline.png skipped" in r.getMessage()]
    assert len(said) == 1 and "matplotlib" in said[0]
    matplotlib_missing_note.cache_clear()
    for d in load_dumps(str(tmp_path)):
        assert "timeline.png" not in d.summary["files"] and not os.path.exists(d.file("timeline.png"))
        assert "matplotlib" in d.summary["skipped_files"]["timeline.png"]
