"""What every command shares: the program name, one-line errors, progress output."""

from __future__ import annotations

import os
import sys

PROG = "python -m fsdp_passes"  # how ``python -m`` runs it; the console script is named by ``prog_name``

BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader closed the pipe


def prog_name(argv0: str | None = None) -> str:
    """The command as the user typed it: the console script's name (``fsdp-passes``) when it is what runs,
    else ``python -m fsdp_passes`` (also when ``main`` is called from another program)."""
    base = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    if base.startswith("fsdp") and not base.endswith(".py"):
        return base
    return PROG

NOTE = ("collectives: before bucketing -> after; exposed comm, makespan, peak memory: the schedule the "
        "reordering pass received (already bucketed) -> the one it chose; all simulated with the cost model.")


class CliError(Exception):
    """An error to report as one line on stderr (exit code 2)."""


def say(text: str) -> None:
    print(text, flush=True)
