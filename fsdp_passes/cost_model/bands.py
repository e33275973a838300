"""Fit a profile's ``small_collective_bands`` to a measured collective sweep.

Where small collectives do not follow the α–β line (a host's per-call cost and thread wake-ups, a traffic
shaper whose burst lets small messages through faster than its rate), a profile can price them from
measurement instead: one band per measured size up to ``max_bytes``, each the time of a call of one ring
step (``call``, per-call cost and step together) and of every further step (``step``) (``profiles`` module
docstring).  The fit reads a
``Calibration`` (the per-size medians of a sweep, ``calibrate``): at each size an all-gather takes ``k = n−1``
ring steps and an all-reduce ``2k`` (a gloo reduce-scatter is its all-reduce, an NCCL one takes an
all-gather's ``k``), so

    t1 = call + (k−1)·step       (median of the ops with k steps)
    t2 = call + (2k−1)·step      (median of the ops with 2k steps)

gives ``step = (t2 − t1)/k`` and ``call = t1 − (k−1)·step`` (two ranks: ``call = t1``, ``step = t2 − t1``).
Load on the host only ever slows a call down, and a call never gets faster with more bytes, so first each of
``t1`` and ``t2`` at a size is made the smallest of its medians at that size and at every larger band size
(one loaded point does not price its band above the larger ones).  Noise can still make ``t2 < t1`` (then
``step = 0`` and ``call`` is the mean of the two); with more than two ranks ``call`` could come out negative
(then ``call = 0`` and ``step`` is the least-squares slope of the two equations).  Last, each band's ``call``
and ``step`` are raised to at least the previous band's, so that more bytes never cost less (the profile
requires it).  The bands are fitted at one group size: at another the per-step time is the fitted group's.
"""

from __future__ import annotations

import statistics

from ..dag.graph import CollectiveOp
from .calibration import Calibration

__all__ = ["fit_small_collective_bands"]


def fit_small_collective_bands(
    calibration: Calibration,
    group_size: int,
    max_bytes: int,
    collective_library: str = "gloo",
) -> tuple[tuple[int, float, float], ...]:
    """Bands ``(max_bytes, call_us, step_us)``, one per size up to ``max_bytes`` at which ``calibration`` has
    an all-gather and an all-reduce (or, on gloo, a reduce-scatter) for ``group_size`` ranks; see the module
    docstring.  Empty when there is no such size."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size={group_size!r} is not valid: expected an integer >= 2")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes!r} is not valid: expected a positive integer")
    if collective_library not in ("gloo", "nccl"):
        raise ValueError(f"collective_library={collective_library!r} is not valid: expected 'gloo' or 'nccl'")
    tables = {op: dict(calibration.points(op, group_size)) for op in
              (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE)}
    rs_two = collective_library == "gloo"  # gloo's reduce-scatter runs a full ring all-reduce
    one_ops = [CollectiveOp.ALL_GATHER] + ([] if rs_two else [CollectiveOp.REDUCE_SCATTER])
    two_ops = [CollectiveOp.ALL_REDUCE] + ([CollectiveOp.REDUCE_SCATTER] if rs_two else [])
    sizes = sorted(set().union(*(t.keys() for t in tables.values())))
    measured: list[tuple[int, float, float]] = []
    for size in sizes:
        if size > max_bytes:
            break
        t1s = [tables[op][size] for op in one_ops if size in tables[op]]
        t2s = [tables[op][size] for op in two_ops if size in tables[op]]
        if t1s and t2s:
            measured.append((size, statistics.median(t1s) * 1e3, statistics.median(t2s) * 1e3))  # ms -> µs
    bands: list[tuple[int, float, float]] = []
    for i, (size, _, _) in enumerate(measured):
        t1 = min(m[1] for m in measured[i:])
        t2 = min(m[2] for m in measured[i:])
        k = group_size - 1
        if t2 < t1:
            call, step = (t1 + t2) / 2, 0.0
        else:
            step = (t2 - t1) / k
            call = t1 - (k - 1) * step
            if call < 0:
                call, step = 0.0, (t1 * (k - 1) + t2 * (2 * k - 1)) / ((k - 1) ** 2 + (2 * k - 1) ** 2)
        if bands:
            call, step = max(call, bands[-1][1]), max(step, bands[-1][2])
        bands.append((int(size), call, step))
    return tuple(bands)
