"""Fit a profile's small-collective prices to a measured collective sweep.

Where small collectives do not follow the α–β line (a host's per-call cost and thread wake-ups, a traffic
shaper whose burst lets small messages through faster than its rate), a profile can price them from
measurement instead (``profiles`` module docstring): ``small_collective_bands``, one band per measured size
up to ``max_bytes``, each the time of a call of one ring step (``call``, per-call cost and step together)
and of every further step (``step``); and ``small_collective_extra_us``, what one op costs beyond the band
price of its step count.  The fit reads a ``Calibration`` (the per-size medians of a sweep, ``calibrate``)
and, when given, every timed sample of each point (``samples``).  The bands come from the two ops that
define the step counts: at each size an all-gather takes ``k = n−1`` ring steps and an all-reduce ``2k``, so

    t1 = call + (k−1)·step       (the all-gather)
    t2 = call + (2k−1)·step      (the all-reduce)

gives ``step = (t2 − t1)/k`` and ``call = t1 − (k−1)·step`` (two ranks: ``call = t1``, ``step = t2 − t1``).
The reduce-scatter takes an all-gather's ``k`` steps on NCCL and runs a full ring all-reduce on gloo, with
host work of its own around it (gloo copies the chunks in and out): its extra is the median, over the band
sizes, of its fitted time less the band price of its step count (never below 0).

Each op's times (``t1``, ``t2``, the reduce-scatter's) are a monotone (isotonic) fit over the band sizes: a
call never gets faster with more bytes, so where a larger size measured faster than a smaller one the
difference is noise, and those sizes share one time.  Each size starts as a block holding its samples (the
timed samples when ``samples`` is given, else the op's median as one sample); going up in size, while a
block's median exceeds the next block's, the two are pooled into one block (pool-adjacent-violators), and
each size's time is the median of its block's pooled samples.  So a flat stretch of sizes is priced by the
median of all its samples, not by its one fastest median.  Noise can still make ``t2 < t1`` (then
``step = 0`` and ``call`` is the mean of the two); with more than two ranks ``call`` could come out negative
(then ``call = 0`` and ``step`` is the least-squares slope of the two equations).  Last, each band's ``call``
and ``step`` are raised to at least the previous band's, so that more bytes never cost less (the profile
requires it).  The prices are fitted at one group size: at another the per-step time is the fitted group's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ..dag.collectives import KINDS
from ..dag.graph import CollectiveOp
from .calibration import Calibration

__all__ = ["fit_small_collectives"]

Samples = Mapping[tuple[CollectiveOp | str, int], Sequence[float]]


def _samples_table(samples: Samples) -> dict[tuple[str, int], list[float]]:
    """``samples`` keyed by (op name, bytes), each a list of positive finite ms; ValueError naming it."""
    if not isinstance(samples, Mapping):
        raise ValueError(f"samples={samples!r} is not valid: expected a mapping (op, bytes) -> [ms, ...]")
    table: dict[tuple[str, int], list[float]] = {}
    for key, times in samples.items():
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], int)
                and not isinstance(key[1], bool)):
            raise ValueError(f"samples: key {key!r} is not valid: expected (op, bytes)")
        op = key[0].value if isinstance(key[0], CollectiveOp) else str(key[0])
        if isinstance(times, (str, bytes)) or not isinstance(times, Sequence) or not times or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
                for t in times):
            raise ValueError(f"samples[{key!r}]={times!r} is not valid: expected a non-empty sequence of "
                             "positive finite times in milliseconds")
        table[op, key[1]] = [float(t) for t in times]
    return table


def _isotonic_medians(blocks: list[list[float]]) -> list[float]:
    """Non-decreasing per-size times: pool adjacent sizes whose medians fall with size (pool-adjacent-
    violators with the median of the pooled samples as a block's value); one time per entry of ``blocks``."""
    pooled: list[tuple[list[float], int]] = []  # (samples, how many sizes)
    for samples in blocks:
        pooled.append((list(samples), 1))
        while len(pooled) > 1 and statistics.median(pooled[-2][0]) > statistics.median(pooled[-1][0]):
            later, n_later = pooled.pop()
            earlier, n_earlier = pooled.pop()
            pooled.append((earlier + later, n_earlier + n_later))
    return [statistics.median(samples) for samples, n in pooled for _ in range(n)]


def fit_small_collectives(
    calibration: Calibration,
    group_size: int,
    max_bytes: int,
    collective_library: str = "gloo",
    samples: Samples | None = None,
) -> dict[str, Any]:
    """The profile fields ``small_collective_bands`` (``(max_bytes, call_us, step_us)``, one per size up to
    ``max_bytes`` at which ``calibration`` has an all-gather and an all-reduce for ``group_size`` ranks) and
    ``small_collective_extra_us`` (the reduce-scatter's, where it was measured at those sizes), ready to put
    in a profile (``profile.replace(**fit)``, or a profile mapping); see the module docstring.
    ``collective_library`` must be the profile's: it says how many ring steps the reduce-scatter's band
    price has, so an extra fitted for gloo would understate an NCCL reduce-scatter and the other way round.
    ``samples``, when given, maps ``(op, bytes)`` to the timed samples (ms) of that point at ``group_size``
    (``calibrate``'s ``samples``), one entry for every point the fit uses.  Both empty when there is no such
    size."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size={group_size!r} is not valid: expected an integer >= 2")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes!r} is not valid: expected a positive integer")
    if collective_library not in ("gloo", "nccl"):
        raise ValueError(f"collective_library={collective_library!r} is not valid: expected 'gloo' or 'nccl'")
    timed = None if samples is None else _samples_table(samples)
    tables = {op: dict(calibration.points(op, group_size)) for op in
              (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE)}

    def block(op: CollectiveOp, size: int) -> list[float]:
        if timed is None:
            return [tables[op][size]]
        if (op.value, size) not in timed:
            raise ValueError(f"samples: no entry for ({op.value!r}, {size}), a point of the fit")
        return timed[op.value, size]

    ag, ar = CollectiveOp.ALL_GATHER, CollectiveOp.ALL_REDUCE
    sizes = [s for s in sorted(tables[ag]) if s <= max_bytes and s in tables[ar]]
    t1s = [t * 1e3 for t in _isotonic_medians([block(ag, s) for s in sizes])]  # ms -> µs
    t2s = [t * 1e3 for t in _isotonic_medians([block(ar, s) for s in sizes])]
    bands: list[tuple[int, float, float]] = []
    k = group_size - 1
    for size, t1, t2 in zip(sizes, t1s, t2s):
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
    extra: dict[str, float] = {}
    rs = CollectiveOp.REDUCE_SCATTER
    rs_bands = [b for b in bands if b[0] in tables[rs]]
    if rs_bands:
        kind = KINDS[rs]
        if collective_library == "gloo" and kind.gloo_priced_as is not None:  # a ring all-reduce on gloo
            kind = KINDS[kind.gloo_priced_as]
        steps = kind.ring_steps(k)
        t_rs = [t * 1e3 for t in _isotonic_medians([block(rs, b[0]) for b in rs_bands])]
        extra[rs.value] = max(0.0, statistics.median(t - (call + (steps - 1) * step)
                                                     for t, (_, call, step) in zip(t_rs, rs_bands)))
    return {"small_collective_bands": tuple(bands), "small_collective_extra_us": tuple(sorted(extra.items()))}
