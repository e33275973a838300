"""The one way the passes tell the user about a problem: a Python warning, and the same text on the
``fsdp_passes`` logger only where logging is configured (without a handler, logging's last resort would print
it to stderr a second time)."""

from __future__ import annotations

import logging
import warnings

log = logging.getLogger("fsdp_passes")

__all__ = ["warn_and_log"]


def warn_and_log(message: str, category: type[Warning], stacklevel: int = 2) -> None:
    """``warnings.warn(message, category)`` attributed ``stacklevel`` frames up from the caller, and
    ``log.warning(message)`` when the ``fsdp_passes`` logger has a handler."""
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    if log.hasHandlers():
        log.warning(message)
