"""Measured times that override the analytic model where they have data.

File format (JSON, written by ``python -m fsdp_passes calibrate``)::

    {
      "format": "fsdp_passes.calibration", "version": 1,
      "meta": {"backend": "gloo", "world_size": 2, ...},          # free-form, informational
      "collectives": [
        {"op": "all_gather", "group_size": 2, "points": [[bytes, ms], ...]}, ...
      ],
      "compute": [
        {"op": "aten.mm.default", "shapes": "float32[64,128];float32[128,32]", "ms": 0.012}, ...
      ],
      "kernels": [                                                  # from a profiled step (trace_calibration)
        {"key": "fused_relu_sum", "ms": 0.004, "count": 3}, ...
      ]
    }

Collective ``bytes`` follow the cost model's convention (full gathered / pre-scatter / buffer size).

Lookup rules:

* At a measured size the measured time is returned exactly.  Between two measured sizes the time is
  interpolated linearly in log(bytes)–log(ms) space (collective times are close to power laws piecewise).
* Outside the measured range the α–β line through the two nearest points is extended (its slope is the
  inverse bandwidth; a negative slope from noise is treated as flat).  Below the range the result is never
  less than ``t0·x/x0`` (the line through the smallest point with zero latency), so it stays positive.
* With fewer than two points for an (op, group size) only an exact size match is answered; otherwise, and
  for group sizes or ops never measured, the answer is ``None`` and the caller falls back to the analytic
  model.
* Compute entries are looked up by (op name, shapes string) exactly; an entry with shapes ``"*"`` matches
  any shapes of that op.
* Kernel entries are measured times of compiled kernels, looked up by a DAG node's ``kernel_key`` exactly;
  the median of every occurrence in the profiled step.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
from typing import Any, Iterable, Mapping, Sequence, Union

from ..dag.graph import CollectiveOp

__all__ = ["Calibration", "shapes_key", "FORMAT", "VERSION"]

FORMAT = "fsdp_passes.calibration"
VERSION = 1
ANY_SHAPES = "*"

PathLike = Union[str, "os.PathLike[str]"]


def _op_name(op: Union[CollectiveOp, str]) -> str:
    return op.value if isinstance(op, CollectiveOp) else str(op)


def shapes_key(values: Iterable[Any]) -> str:
    """The shapes string of a compute op's tensor arguments: ``"float32[64,128];bfloat16[128]"``.

    Accepts tensors (real, fake, meta) or anything with ``.shape`` and optionally ``.dtype``; other values
    (scalars, None) are skipped so that only tensor shapes identify an entry.
    """
    parts = []
    for v in values:
        shape = getattr(v, "shape", None)
        if shape is None or isinstance(v, (str, bytes)):
            continue
        dtype = getattr(v, "dtype", None)
        name = str(dtype).replace("torch.", "") if dtype is not None else ""
        parts.append(f"{name}[{','.join(str(d) for d in shape)}]")
    return ";".join(parts)


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


class Calibration:
    """A table of measured collective and compute times; see the module docstring for the lookup rules."""

    def __init__(
        self,
        collectives: Mapping[tuple[str, int], Sequence[tuple[float, float]]] | None = None,
        compute: Mapping[tuple[str, str], float] | None = None,
        meta: Mapping[str, Any] | None = None,
    ):
        self.meta: dict[str, Any] = dict(meta or {})
        self._coll: dict[tuple[str, int], dict[int, list[float]]] = {}
        self._compute: dict[tuple[str, str], float] = {}
        self._sorted: dict[tuple[str, int], tuple[list[int], list[float]]] = {}
        self._kernels: dict[str, tuple[float, int]] = {}
        for (op, n), points in (collectives or {}).items():
            for nbytes, ms in points:
                self.add_collective(op, n, nbytes, ms)
        for (op, shapes), ms in (compute or {}).items():
            self.add_compute(op, shapes, ms)

    # -- building -------------------------------------------------------------------------------------------
    def add_collective(self, op: Union[CollectiveOp, str], group_size: int, nbytes: int, ms: float) -> None:
        """Record one measurement; repeated sizes are averaged."""
        name = _op_name(op)
        if not name:
            raise ValueError("collective op: expected a non-empty op name such as 'all_gather'")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r} is not valid: expected an integer >= 1")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or nbytes < 1 or int(nbytes) != nbytes:
            raise ValueError(f"bytes={nbytes!r} is not valid: expected a positive integer number of bytes")
        if not _positive(ms):
            raise ValueError(f"ms={ms!r} is not valid: expected a positive finite time in milliseconds")
        self._coll.setdefault((name, group_size), {}).setdefault(int(nbytes), []).append(float(ms))
        self._sorted.pop((name, group_size), None)

    def add_compute(self, op: str, shapes: str, ms: float) -> None:
        """Record the time of one compute op at given shapes (``"*"``: any shapes)."""
        if not isinstance(op, str) or not op:
            raise ValueError(f"compute op={op!r} is not valid: expected a non-empty op name")
        if not isinstance(shapes, str):
            raise ValueError(f"shapes={shapes!r} is not valid: expected a shapes string (see shapes_key) or '*'")
        if not _positive(ms) and ms != 0:
            raise ValueError(f"ms={ms!r} is not valid: expected a non-negative finite time in milliseconds")
        self._compute[(op, shapes)] = float(ms)

    def add_kernel(self, key: str, ms: float, count: int = 1) -> None:
        """Record the measured time of a compiled kernel (``count``: how many runs the time summarises)."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"kernel key={key!r} is not valid: expected a non-empty kernel name")
        if not _positive(ms) and ms != 0:
            raise ValueError(f"ms={ms!r} is not valid: expected a non-negative finite time in milliseconds")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count={count!r} is not valid: expected an integer >= 1")
        self._kernels[key] = (float(ms), count)

    def kernel_ms(self, key: str | None) -> float | None:
        """Measured time of the kernel with this key, else None."""
        hit = self._kernels.get(key) if key else None
        return hit[0] if hit is not None else None

    def kernel_keys(self) -> list[str]:
        return sorted(self._kernels)

    def update(self, other: "Calibration") -> None:
        """Merge another table into this one (its points are added, its compute entries win)."""
        for (op, n), pts in other._coll.items():
            for nbytes, values in pts.items():
                for ms in values:
                    self.add_collective(op, n, nbytes, ms)
        self._compute.update(other._compute)
        self._kernels.update(other._kernels)
        self.meta.update(other.meta)

    # -- queries --------------------------------------------------------------------------------------------
    def points(self, op: Union[CollectiveOp, str], group_size: int) -> list[tuple[int, float]]:
        """Measured (bytes, ms) points of one collective, sorted by size."""
        xs, ys = self._table(_op_name(op), group_size)
        return list(zip(xs, ys))

    def collective_keys(self) -> list[tuple[str, int]]:
        return sorted(self._coll)

    def compute_keys(self) -> list[tuple[str, str]]:
        return sorted(self._compute)

    def _table(self, op: str, group_size: int) -> tuple[list[int], list[float]]:
        key = (op, group_size)
        table = self._sorted.get(key)
        if table is None:
            pts = self._coll.get(key, {})
            xs = sorted(pts)
            ys = [sum(pts[x]) / len(pts[x]) for x in xs]
            table = self._sorted[key] = (xs, ys)
        return table

    def collective_ms(self, op: Union[CollectiveOp, str], nbytes: int, group_size: int) -> float | None:
        """Measured / interpolated / extrapolated time, or None where the table cannot answer."""
        xs, ys = self._table(_op_name(op), group_size)
        if not xs or nbytes is None or nbytes <= 0:
            return None
        i = bisect.bisect_left(xs, nbytes)
        if i < len(xs) and xs[i] == nbytes:
            return ys[i]
        if len(xs) < 2:
            return None
        if 0 < i < len(xs):
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            w = (math.log(nbytes) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
        if i == 0:
            (x0, y0), (x1, y1) = (xs[0], ys[0]), (xs[1], ys[1])
            slope = max(0.0, (y1 - y0) / (x1 - x0))
            return max(y0 - slope * (x0 - nbytes), y0 * nbytes / x0)
        (x0, y0), (x1, y1) = (xs[-2], ys[-2]), (xs[-1], ys[-1])
        slope = max(0.0, (y1 - y0) / (x1 - x0))
        return y1 + slope * (nbytes - x1)

    def compute_ms(self, op: str, shapes: str | None) -> float | None:
        """Measured time of ``op`` at ``shapes`` (or its ``"*"`` entry), else None."""
        if shapes is not None:
            hit = self._compute.get((op, shapes))
            if hit is not None:
                return hit
        return self._compute.get((op, ANY_SHAPES))

    def has_compute(self, op: str) -> bool:
        return any(k[0] == op for k in self._compute)

    # -- (de)serialisation ----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "meta": self.meta,
            "collectives": [
                {"op": op, "group_size": n, "points": [[x, y] for x, y in self.points(op, n)]}
                for op, n in self.collective_keys()
            ],
            "compute": [{"op": op, "shapes": s, "ms": self._compute[(op, s)]} for op, s in self.compute_keys()],
            "kernels": [{"key": k, "ms": self._kernels[k][0], "count": self._kernels[k][1]}
                        for k in self.kernel_keys()],
        }

    def digest(self) -> str:
        """A short stable hash of the table, for cache keys."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_json(cls, data: Any, source: str = "calibration data") -> "Calibration":
        """Parse the JSON form; any problem is a ValueError naming ``source`` and the offending entry."""

        def fail(problem: str) -> ValueError:
            return ValueError(f"{source}: {problem}")

        if not isinstance(data, Mapping):
            raise fail(f"expected a JSON object at the top level, got {type(data).__name__}")
        known = list(cls().to_json())  # the keys this version writes are the keys it reads
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise fail(f"unknown key(s) {', '.join(map(repr, unknown))}: expected an object with keys "
                       f"{', '.join(known)} (as 'python -m fsdp_passes calibrate' writes it)")
        if data.get("format", FORMAT) != FORMAT:
            raise fail(f"format={data.get('format')!r}, expected {FORMAT!r}")
        version = data.get("version", VERSION)
        if version != VERSION:
            raise fail(f"version={version!r} is not supported, expected {VERSION}")
        meta = data.get("meta", {})
        if not isinstance(meta, Mapping):
            raise fail("'meta' must be an object")
        cal = cls(meta=meta)
        colls = data.get("collectives", [])
        if not isinstance(colls, list):
            raise fail("'collectives' must be a list of {op, group_size, points} objects")
        for k, entry in enumerate(colls):
            where = f"collectives[{k}]"
            if not isinstance(entry, Mapping) or not {"op", "group_size", "points"} <= set(entry):
                raise fail(f"{where}: expected an object with 'op', 'group_size' and 'points'")
            points = entry["points"]
            if not isinstance(points, list):
                raise fail(f"{where}.points: expected a list of [bytes, ms] pairs")
            for j, point in enumerate(points):
                if not isinstance(point, (list, tuple)) or len(point) != 2:
                    raise fail(f"{where}.points[{j}]={point!r}: expected a [bytes, ms] pair")
                try:
                    cal.add_collective(entry["op"], entry["group_size"], point[0], point[1])
                except ValueError as exc:
                    raise fail(f"{where}.points[{j}]: {exc}") from None
        comps = data.get("compute", [])
        if not isinstance(comps, list):
            raise fail("'compute' must be a list of {op, shapes, ms} objects")
        for k, entry in enumerate(comps):
            where = f"compute[{k}]"
            if not isinstance(entry, Mapping) or not {"op", "shapes", "ms"} <= set(entry):
                raise fail(f"{where}: expected an object with 'op', 'shapes' and 'ms'")
            try:
                cal.add_compute(entry["op"], entry["shapes"], entry["ms"])
            except ValueError as exc:
                raise fail(f"{where}: {exc}") from None
        kernels = data.get("kernels", [])
        if not isinstance(kernels, list):
            raise fail("'kernels' must be a list of {key, ms, count} objects")
        for k, entry in enumerate(kernels):
            where = f"kernels[{k}]"
            if not isinstance(entry, Mapping) or not {"key", "ms"} <= set(entry):
                raise fail(f"{where}: expected an object with 'key' and 'ms'")
            try:
                cal.add_kernel(entry["key"], entry["ms"], entry.get("count", 1))
            except ValueError as exc:
                raise fail(f"{where}: {exc}") from None
        return cal

    @classmethod
    def load(cls, path: PathLike) -> "Calibration":
        """Read a calibration file; a missing, unreadable or malformed file is a ValueError naming it."""
        name = os.fspath(path)
        try:
            with open(name, encoding="utf-8") as fh:
                data = json.load(fh)
        except OSError as exc:
            raise ValueError(f"calibration file {name}: cannot read it ({exc.strerror or exc})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"calibration file {name}: not valid JSON ({exc})") from None
        return cls.from_json(data, source=f"calibration file {name}")

    def save(self, path: PathLike) -> None:
        """Write the table as JSON (atomically: a reader never sees half a file)."""
        name = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(name))
        os.makedirs(folder, exist_ok=True)
        tmp = f"{name}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.to_json(), fh, indent=1, sort_keys=False)
            fh.write("\n")
        os.replace(tmp, name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Calibration) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return (f"Calibration({len(self._coll)} collective tables, {len(self._compute)} compute entries, "
                f"{len(self._kernels)} kernels)")
