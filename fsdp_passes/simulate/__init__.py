"""Timeline simulation of an order: one compute stream plus one FIFO stream per process group."""

from .bounds import lower_bound
from ..dag.graph import buffer_roots
from .memory import memory_curve, peak_memory
from .timeline import OverlapCosts, Timeline, check_order, simulate
from .trace import chrome_trace, write_chrome_trace

__all__ = [
    "OverlapCosts",
    "Timeline",
    "buffer_roots",
    "check_order",
    "chrome_trace",
    "lower_bound",
    "memory_curve",
    "peak_memory",
    "simulate",
    "write_chrome_trace",
]
