"""``collector_paused``: run a block with Python's cyclic garbage collector paused."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block (reference counting still frees everything at once).

    Building a DAG, planning buckets and planning an order allocate several small lists and tuples per node
    and keep them alive; each allocation burst triggers collections, and the full ones rescan every live
    container (the passes' own and the rest of the compiler's heap), about a third of the passes' time at
    100k nodes.  What the passes build has no reference cycles, so nothing is left for the collector to find.
    Usable as a decorator; nests: only the outermost block turns the collector back on, and only if it was on.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
