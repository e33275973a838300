"""What every command shares: the program name, one-line errors, progress output."""

from __future__ import annotations

PROG = "python -m fsdp_passes"

NOTE = ("collectives: before bucketing -> after; exposed comm, makespan, peak memory: the schedule the "
        "reordering pass received (already bucketed) -> the one it chose; all simulated with the cost model.")


class CliError(Exception):
    """An error to report as one line on stderr (exit code 2)."""


def say(text: str) -> None:
    print(text, flush=True)
