"""The one engine for time and memory: one compute stream plus one FIFO stream per process group
(``StreamClock``) and live bytes (``MemoryModel`` / ``MemoryTracker``), advanced node by node; ``simulate``
replays a whole order."""

from .bounds import lower_bound, overlap_lower_bound
from ..dag.graph import buffer_roots
from .memory import MemoryModel, MemoryTracker, memory_curve, peak_memory
from .timeline import (OverlapCosts, StreamClock, Timeline, check_order, exposed_and_makespan, simulate,
                       slowed_end)
from .gaps import GapParts, gap_parts
from .trace import chrome_trace, write_chrome_trace

__all__ = [
    "GapParts",
    "MemoryModel",
    "OverlapCosts",
    "MemoryTracker",
    "StreamClock",
    "Timeline",
    "buffer_roots",
    "check_order",
    "chrome_trace",
    "exposed_and_makespan",
    "gap_parts",
    "lower_bound",
    "memory_curve",
    "overlap_lower_bound",
    "peak_memory",
    "simulate",
    "slowed_end",
    "write_chrome_trace",
]
