"""Reordering policy: where to issue each collective and wait so that communication overlaps compute.

A pure function over the neutral DAG (``fsdp_passes.dag``); it imports nothing from ``torch._inductor``.
Time and memory are the simulator's (``fsdp_passes.simulate``).
``plan_order`` returns node ids in the order to run them; the Inductor adapter maps them back onto
scheduler nodes.  See docs/reordering.md.
"""

from .async_tracker import AsyncTracker
from .headroom import HeadroomTree
from .plan import OrderStats, ReorderResult, evaluate, plan_order
from .scheduler import ListScheduler
from .structure import Structure, as_durations

__all__ = [
    "AsyncTracker",
    "HeadroomTree",
    "ListScheduler",
    "OrderStats",
    "ReorderResult",
    "Structure",
    "as_durations",
    "evaluate",
    "plan_order",
]
