"""A problem the passes report reaches a user once: as a Python warning, and on the ``fsdp_passes`` logger only
when logging is configured (logging's last-resort handler would otherwise print the same text a second time).
Run in a fresh interpreter: pytest installs logging handlers of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SCRIPT = """
import logging, sys
if sys.argv[1] == "configured":
    logging.basicConfig(format="LOGGED %(message)s")
from fsdp_passes.debug.dump import _dump_failed
from fsdp_passes.inductor.guard import run_guarded
from fsdp_passes.inductor.param_names import _warn_no_collective_once
from fsdp_passes.options import Options

def fail():
    raise RuntimeError("boom")

run_guarded("fx", Options(), fail, lambda reason: None)
_dump_failed("000_fwd", OSError("disk full"))
_warn_no_collective_once()
"""


@pytest.mark.parametrize("logging_configured", [False, True])
def test_each_problem_is_printed_once_without_logging_and_logged_with_it(logging_configured):
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, "configured" if logging_configured else "plain"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = proc.stderr
    for text in ("boom", "disk full", "no collective was traced"):
        lines = [line for line in err.splitlines() if text in line]
        warned = [line for line in lines if "Warning:" in line]
        logged = [line for line in lines if line.startswith("LOGGED ")]
        assert len(warned) == 1, (text, lines)
        assert len(logged) == (1 if logging_configured else 0), (text, lines)
        assert len(lines) == 1 + len(logged), (text, lines)
