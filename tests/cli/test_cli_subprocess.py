"""The command line as a user runs it, in subprocesses: defaults that follow the dump (compared with the same
command given the options explicitly, run in process), closed pipes; and help."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fsdp_passes.debug import load_dumps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_passes", *args], capture_output=True, text=True, env=ENV,
                          timeout=120)


@pytest.fixture(scope="module")
def a100_dump(tmp_path_factory):
    """A dump made on the a100 profile with a 4-rank world (neither is the CLI's fallback default)."""
    from fsdp_passes.testing import build_mlp, capture_scheduler_nodes, example_inputs, fake_process_group

    folder = str(tmp_path_factory.mktemp("a100_dump"))
    with fake_process_group(world_size=4):
        model = build_mlp(n_layers=2, dim=32, reshard_after_forward=True)
        capture_scheduler_nodes(model, *example_inputs(model),
                                options={"cluster": "a100", "bucketing": "none", "debug_dir": folder})
    return folder


def _rows(text: str) -> dict[str, list[str]]:
    return {ln.split()[0]: ln.split() for ln in text.splitlines() if ln[:3].isdigit()}


def _simulate_in_process(capsys, *args: str) -> str:
    from fsdp_passes.__main__ import main

    assert main(["simulate", *args]) == 0
    return capsys.readouterr().out


def test_simulate_defaults_to_the_dumps_cluster_and_world_size(a100_dump, capsys):
    default = run_cli("simulate", a100_dump, "--no-replan")
    assert default.returncode == 0, default.stderr
    assert "cluster a100 (from the dump), world size 4 (from the dump)" in default.stdout
    on_a100 = _simulate_in_process(capsys, a100_dump, "--no-replan", "--cluster", "a100")
    on_h100 = _simulate_in_process(capsys, a100_dump, "--no-replan", "--cluster", "h100-nvlink")
    assert _rows(default.stdout) == _rows(on_a100) != _rows(on_h100)
    # and it reproduces what the compile priced (summary.json, written with the a100 profile)
    for d in load_dumps(a100_dump):
        row = _rows(default.stdout)[d.name]
        assert row[2] == "4"
        assert float(row[3]) == pytest.approx(d.summary["makespan_ms_before"], abs=1e-3)
        assert float(row[5]) == pytest.approx(d.summary["makespan_ms_after"], abs=1e-3)


def test_report_into_a_closed_pipe_ends_quietly(a100_dump):
    # the reader is gone before the first line is written: deterministic, unlike `| head -1`
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_passes", "report", a100_dump], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141  # 128 + SIGPIPE, as the shell reports a writer whose reader left
    assert err == ""
    shell = subprocess.run(["bash", "-c", f'"{sys.executable}" -m fsdp_passes report "{a100_dump}" | head -1'],
                           capture_output=True, text=True, env=ENV, timeout=120)
    assert shell.stdout.startswith("2 graph(s) in") and shell.stdout.count("\n") == 1
    assert "error" not in shell.stderr and "Traceback" not in shell.stderr, shell.stderr


def test_simulate_help_says_its_defaults_follow_the_dump(capsys):
    simulate = _help(["simulate"], capsys)
    text = " ".join(simulate.split())
    assert simulate.startswith("usage: python -m fsdp_passes simulate")
    assert "default: the cluster the dump was made with" in text
    assert "default: the world size the dump was made with" in text


def _help(argv: list[str], capsys) -> str:
    from fsdp_passes.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_calibrate_help_shows_defaults(capsys):
    text = " ".join(_help(["calibrate"], capsys).split())
    assert "(default: 20)" in text and "(default: 3)" in text and "(default: float32)" in text


def test_console_script_names_itself(monkeypatch, capsys):
    # setuptools' console-script wrapper sets argv[0] to the script's path and calls main()
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/fsdp-passes"])
    assert _help(["report"], capsys).startswith("usage: fsdp-passes report")
    monkeypatch.setattr(sys, "argv", ["/x/site-packages/fsdp_passes/__main__.py"])
    assert _help(["report"], capsys).startswith("usage: python -m fsdp_passes report")
