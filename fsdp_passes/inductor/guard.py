"""Running a pass so that a failure never breaks the user's compile (unless ``strict``)."""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from ..dag.from_fx import UnplannableGraph
from ..debug.warn import warn_and_log
from ..options import Options

log = logging.getLogger("fsdp_passes")

T = TypeVar("T")

__all__ = ["FsdpPassError", "run_guarded"]


class FsdpPassError(RuntimeError):
    """A pass failed (raised only with ``strict=True``; otherwise a warning and the graph is left as it was)."""


def run_guarded(pass_name: str, options: Options, fn: Callable[[], T], fallback: Callable[[str], T],
                skipped: Callable[[str], T] | None = None) -> T:
    """Run ``fn``; on any exception warn (naming the pass and the reason) and return ``fallback(reason)``,
    or raise ``FsdpPassError`` when ``options.strict``.

    A graph the passes leave alone by design (``UnplannableGraph``: unbacked sizes, unsupported node kinds)
    is not a failure: one INFO line says why and ``skipped(reason)`` (default ``fallback(reason)``) is
    returned, with or without ``strict``; no warning.
    """
    try:
        return fn()
    except UnplannableGraph as exc:
        log.info("fsdp_passes %s pass: graph left untouched: %s", pass_name, exc)
        return (skipped or fallback)(str(exc))
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        message = f"fsdp_passes {pass_name} pass failed, graph left as it was: {reason}"
        if options.strict:
            raise FsdpPassError(message) from exc
        warn_and_log(message, RuntimeWarning)
        return fallback(reason)
