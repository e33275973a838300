"""Making a pass fail on purpose, for tests of the fallback path."""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["inject_failure", "injected"]

# pass name -> failure mode, while an ``inject_failure`` block is open
_INJECTED: dict[str, str] = {}


@contextlib.contextmanager
def inject_failure(pass_name: str, mode: str = "exception") -> Iterator[None]:
    """Make pass ``pass_name`` ("fx" or "scheduler") fail: mode "exception" raises inside it, "bad_order"
    (scheduler only) makes it propose an order that breaks a dependency."""
    if pass_name not in ("fx", "scheduler") or mode not in ("exception", "bad_order"):
        raise ValueError(f"inject_failure({pass_name!r}, {mode!r}): pass is 'fx' or 'scheduler', mode 'exception' or 'bad_order'")
    _INJECTED[pass_name] = mode
    try:
        yield
    finally:
        _INJECTED.pop(pass_name, None)


def injected(pass_name: str) -> str | None:
    return _INJECTED.get(pass_name)
