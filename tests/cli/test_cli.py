"""``python -m fsdp_passes``: demo, report (one and two folders), simulate, calibrate wiring, help, errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from fsdp_passes.__main__ import build_parser, main
from fsdp_passes.debug import SUMMARY_KEYS, load_dumps, parse_schedule_table, read_dag_json
from fsdp_passes.debug.whatif import what_if
from fsdp_passes.simulate import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--layers", "1", "--dim", "32", "--seq-len", "16"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "fsdp_passes", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory):
    """Two tiny demo runs, in process: bucketing auto and none."""
    import torch._dynamo

    out = {}
    for mode in ("auto", "none"):
        folder = str(tmp_path_factory.mktemp(f"demo_{mode}"))
        import io
        from contextlib import redirect_stdout

        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = main(["demo", *TINY, "--bucketing", mode, "--out", folder])
        assert rc == 0, buf.getvalue()
        out[mode] = (folder, buf.getvalue())
    torch._dynamo.reset()
    return out


def test_help_of_every_command(capsys):
    for argv in ([], ["demo"], ["report"], ["simulate"], ["calibrate"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith("usage: python -m fsdp_passes")
    for command in ("demo", "report", "simulate", "calibrate"):
        assert command in build_parser().format_help()


def test_console_script_entry_point_and_module_help():
    proc = run_cli("--help")
    assert proc.returncode == 0 and "demo" in proc.stdout and "simulate" in proc.stdout
    from fsdp_passes.__main__ import main as entry

    assert callable(entry)


def test_calibrate_as_a_module_spawns_ranks(tmp_path):
    """``python -m fsdp_passes calibrate`` outside torchrun spawns gloo ranks, which must be able to unpickle
    what they are sent; the table they write holds the requested sizes for a 2-rank group."""
    out = tmp_path / "cal.json"
    proc = run_cli("calibrate", "--out", str(out), "--sizes", "4K", "16K", "--iters", "2", "--warmup", "1",
                   "--ops", "all_reduce", "--world-size", "2")
    assert proc.returncode == 0, proc.stderr
    # it says what it measures, then one line per point as it goes (a default sweep takes tens of seconds)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("calibrate: 1 collective(s) x 2 size(s) on 2 gloo rank(s)"), proc.stdout
    assert [line.split(":")[1].strip() for line in lines[1:3]] == ["all_reduce 4096 B", "all_reduce 16384 B"]
    assert lines[-1] == f"calibrate: wrote {out}"
    data = json.loads(out.read_text())
    assert data["meta"]["world_size"] == 2 and data["meta"]["backend"] == "gloo"
    (entry,) = data["collectives"]
    assert entry["op"] == "all_reduce" and entry["group_size"] == 2
    assert [size for size, _ in entry["points"]] == [4096, 16384]


def test_demo_prints_progress_tables_and_writes_dumps(demo_dirs):
    folder, text = demo_dirs["auto"]
    for phrase in ("building a Llama-style model: 1 layers, dim 32", "sharding it with fsdp_passes.data_parallel",
                   "compiling forward", "compiling backward", "collectives", "exposed comm ms", "makespan ms",
                   "peak memory", "lower bound ms", "trace: ", f"report {folder}"):
        assert phrase in text, phrase
    dumps = load_dumps(folder)
    assert [d.name.split("_")[1] for d in dumps] == ["fwd", "bwd"]
    for d in dumps:
        assert set(SUMMARY_KEYS) <= set(d.summary)
        assert d.name in text and d.file("trace.json") in text
        dump = read_dag_json(d.file("dag.json"))
        tl = simulate(dump.dag, dump.after, dump.durations, dump.overlap)
        assert d.summary["makespan_ms_after"] == pytest.approx(tl.makespan)
        assert f"{tl.makespan:.3f}" in text
        rows = parse_schedule_table(open(d.file("schedule_after.txt")).read())
        assert len(rows) == len(dump.dag)
        assert d.summary["options"]["bucketing"] == "auto"
    # bucketing merged collectives in the demo model (n before counts them before the FX pass)
    fwd = dumps[0].summary
    assert fwd["n_collectives_before"] >= fwd["n_collectives_after"] > 0


def _headline(text: str) -> dict[str, list[str]]:
    """The demo's headline table: label -> [before, after] cells (label words removed)."""
    lines = text.splitlines()
    start = next(k for k, ln in enumerate(lines) if ln.startswith("step without any pass"))
    out = {}
    for label in ("collectives", "exposed comm ms", "makespan ms"):
        row = next(ln for ln in lines[start:start + 7] if ln.strip().startswith(label))
        out[label] = row.strip()[len(label):].split()[:2]
    return out


def test_demo_headline_is_against_the_step_without_passes(demo_dirs):
    """auto and none are reported against the same baseline: the step compiled without any pass."""
    auto_folder, auto_text = demo_dirs["auto"]
    none_folder, none_text = demo_dirs["none"]
    auto, none = _headline(auto_text), _headline(none_text)
    baseline = load_dumps(os.path.join(auto_folder, "baseline"))
    assert len(baseline) == 2
    for d in baseline:  # the baseline is the unchanged step
        dump = read_dag_json(d.file("dag.json"))
        assert dump.after == dump.before
        assert d.summary["options"]["bucketing"] == "none" and d.summary["options"]["reorder"] is False
    # each graph's peak, without any pass -> with the passes, from the two dump folders
    from fsdp_passes.debug.tables import format_bytes

    for b, p in zip(baseline, load_dumps(auto_folder)):
        line = next(ln for ln in auto_text.splitlines() if ln.strip().startswith(p.summary["graph"] + ": "))
        assert f"{format_bytes(b.summary['peak_memory_bytes_after'])} -> " \
               f"{format_bytes(p.summary['peak_memory_bytes_after'])}" in line, line
    dags = [read_dag_json(d.file("dag.json")) for d in baseline]
    step_ms = sum(simulate(x.dag, x.before, x.durations, x.overlap).makespan for x in dags)
    assert auto["makespan ms"][0] == none["makespan ms"][0] == f"{step_ms:.3f}"
    assert auto["exposed comm ms"][0] == none["exposed comm ms"][0]
    # the baseline's collectives are those before bucketing (counted by the FX pass on the FX graph)
    fx_before = sum(d.summary["n_collectives_before"] for d in load_dumps(auto_folder))
    assert auto["collectives"][0] == none["collectives"][0] == str(fx_before)
    assert int(auto["collectives"][1]) < fx_before  # auto bucketing merged some
    # the dumps line lists the files each graph folder has
    files = load_dumps(auto_folder)[0].summary["files"]
    assert f"dumps: {auto_folder}/<graph>/ ({', '.join(files)})" in auto_text
    if "timeline.png" not in files:
        assert "timeline.png skipped: matplotlib is not installed" in auto_text


def test_demo_replaces_an_earlier_runs_dumps(tmp_path):
    stale = tmp_path / "999_fwd_old"
    stale.mkdir()
    (stale / "summary.json").write_text(json.dumps({"graph": "999_fwd_old"}))
    keep = tmp_path / "notes"
    keep.mkdir()
    (keep / "mine.txt").write_text("x")
    import io
    from contextlib import redirect_stdout

    with redirect_stdout(io.StringIO()) as buf:
        # 3 ranks do not divide the width 32: data_parallel pads the shards
        assert main(["demo", *TINY, "--bucketing", "manual", "--world-size", "3", "--out", str(tmp_path)]) == 0
    assert not stale.exists() and (keep / "mine.txt").exists()
    assert "removed 1 graph dump(s)" in buf.getvalue()
    dumps = load_dumps(str(tmp_path))
    assert len(dumps) == 2
    assert dumps[0].summary["options"]["bucket_plan"][:2] == ["tok_embeddings", "layers.[0-0]"]
    dump = read_dag_json(dumps[0].file("dag.json"))
    assert {dump.dag.nodes[c].group_size for c in dump.dag.collectives()} == {3}


def test_report_one_folder(demo_dirs, capsys):
    folder, _ = demo_dirs["auto"]
    assert main(["report", folder]) == 0
    text = capsys.readouterr().out
    dumps = load_dumps(folder)
    assert text.startswith(f"2 graph(s) in {folder}")
    for d in dumps:
        s = d.summary
        assert d.name in text
        lines = text.splitlines()
        start = next(k for k, ln in enumerate(lines) if ln.startswith(d.name))
        line = next(ln for ln in lines[start:] if ln.strip().startswith("makespan ms"))
        assert f"{s['makespan_ms_before']:.3f}" in line and f"{s['makespan_ms_after']:.3f}" in line
    assert "all 2 graphs" in text
    # a single graph's folder works too
    assert main(["report", dumps[0].path]) == 0
    assert capsys.readouterr().out.startswith(f"1 graph(s) in {dumps[0].path}")


def test_report_two_folders_side_by_side(demo_dirs, capsys):
    auto, _ = demo_dirs["auto"]
    none, _ = demo_dirs["none"]
    assert main(["report", none, auto]) == 0
    text = capsys.readouterr().out
    assert f"A = {none}" in text and f"B = {auto}" in text
    assert "A before" in text and "B after" in text
    a, b = load_dumps(none), load_dumps(auto)
    # graphs are matched by name, or in compile order when another run numbered them differently
    assert [d.name.split("_")[1] for d in a] == [d.name.split("_")[1] for d in b] == ["fwd", "bwd"]
    coll = [ln for ln in text.splitlines() if ln.startswith("  collectives ")]
    assert len(coll) == 3  # two graphs and the totals
    cells = coll[0].split()
    assert int(cells[1]) == a[0].summary["n_collectives_before"]
    assert int(cells[4]) == b[0].summary["n_collectives_after"]


def test_simulate_what_if(demo_dirs, capsys):
    folder, _ = demo_dirs["auto"]
    assert main(["simulate", folder, "--cluster", "a100", "--world-size", "32"]) == 0
    text = capsys.readouterr().out
    assert "cluster a100, world size 32 (model size fixed)" in text
    dumps = load_dumps(folder)
    for d in dumps:
        r = what_if(read_dag_json(d.file("dag.json")), "a100", world_size=32)
        row = next(ln for ln in text.splitlines() if ln.startswith(d.name))
        cells = row.split()
        assert cells[2] == "8->32"
        assert float(cells[3]) == pytest.approx(r.before_ms, abs=1e-3)
        assert float(cells[5]) == pytest.approx(r.dumped_ms, abs=1e-3)
        assert r.lower_bound_ms <= r.before_ms + 1e-9
    assert "step (sum)" in text
    # the same world size on the same profile predicts what was dumped
    assert main(["simulate", folder, "--cluster", "h100-nvlink", "--no-replan"]) == 0
    text = capsys.readouterr().out
    for d in dumps:
        row = next(ln for ln in text.splitlines() if ln.startswith(d.name)).split()
        assert float(row[3]) == pytest.approx(d.summary["makespan_ms_before"], abs=1e-3)
        assert float(row[5]) == pytest.approx(d.summary["makespan_ms_after"], abs=1e-3)
    # shard-fixed scaling moves more bytes than model-fixed scaling
    m = what_if(read_dag_json(dumps[1].file("dag.json")), "a100", world_size=64, fixed="model", replan=False)
    s = what_if(read_dag_json(dumps[1].file("dag.json")), "a100", world_size=64, fixed="shard", replan=False)
    assert s.before_ms > m.before_ms


def _one_line_error(capsys, argv, needle):
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_errors_are_one_line(tmp_path, demo_dirs, capsys):
    folder, _ = demo_dirs["auto"]
    _one_line_error(capsys, ["report", str(tmp_path / "missing")], "no such folder")
    _one_line_error(capsys, ["report", str(tmp_path)], "no fsdp_passes dumps")
    _one_line_error(capsys, ["simulate", folder, "--cluster", "nope"], "unknown cluster profile 'nope'")
    _one_line_error(capsys, ["simulate", folder, "--world-size", "0"], "--world-size 0")
    _one_line_error(capsys, ["demo", "--dim", "34", "--out", str(tmp_path / "d")], "expected a multiple of 4")
    _one_line_error(capsys, ["demo", "--cluster", "nope", "--out", str(tmp_path / "d")], "cluster")
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    graph = sorted(p for p in os.listdir(broken) if os.path.isdir(broken / p))[0]
    (broken / graph / "dag.json").write_text("{\"format\": \"fsdp_passes.dag\", ")
    _one_line_error(capsys, ["simulate", str(broken)], "dag.json: not valid JSON")
    (broken / graph / "summary.json").write_text("[1, 2")
    line = _one_line_error(capsys, ["report", str(broken)], "summary.json: not valid JSON")
    assert line.startswith("python -m fsdp_passes report: error: ")


def test_errors_in_a_subprocess_have_no_traceback(tmp_path):
    proc = run_cli("report", str(tmp_path / "missing"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"python -m fsdp_passes report: error: {tmp_path / 'missing'}: no such folder"]


def test_calibrate_is_wired(tmp_path, capsys):
    # argument validation runs before anything is spawned
    _one_line_error(capsys, ["calibrate", "--out", str(tmp_path / "c.json"), "--iters", "0"], "--iters 0")
