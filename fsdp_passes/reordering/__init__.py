"""Reordering policy: where to issue each collective and wait so that communication overlaps compute.

A pure function over the neutral DAG (``fsdp_passes.dag``); it imports nothing from ``torch._inductor``.
``plan_order`` returns node ids in the order to run them; the Inductor adapter maps them back onto
scheduler nodes.  See docs/reordering.md.
"""

from .memory import HeadroomTree, MemoryModel, MemoryTracker
from .async_tracker import AsyncTracker
from .plan import OrderStats, ReorderResult, evaluate, plan_order, replay
from .scheduler import ListScheduler
from .structure import Structure, as_durations

__all__ = [
    "AsyncTracker",
    "HeadroomTree",
    "ListScheduler",
    "MemoryModel",
    "MemoryTracker",
    "OrderStats",
    "ReorderResult",
    "Structure",
    "as_durations",
    "evaluate",
    "plan_order",
    "replay",
]
