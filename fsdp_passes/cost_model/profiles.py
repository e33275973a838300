"""Cluster profiles: the hardware numbers the analytic cost model runs on.

A profile is a flat, frozen record so it can be hashed, compared and put in cache keys.  Shipped profiles
live in ``profiles/<name>.json`` next to this module (package data); a user profile is a mapping of the same
fields, optionally starting from a shipped one with ``"base": "<name>"``.

Conventions (see each shipped JSON's ``description`` for its sources):

* Bandwidths are *achieved NCCL bus bandwidths* in GB/s (10**9 bytes/s), the number nccl-tests prints as
  ``busbw`` on its plateau, not link line rates.  ``intra_node_bw_gbps`` is the ring bus bandwidth of a group
  inside one node; ``inter_node_bw_per_nic_gbps`` is what one NIC sustains.
* Latencies follow NCCL's tuning model, for two protocols: *Simple* (full bandwidth, higher latency) and
  *LL* (low latency, ``ll_bandwidth_fraction`` of the bandwidth; 0 disables it, e.g. for gloo).  Each
  algorithm (ring, tree) has a base latency; every ring step / tree level adds a per-hop latency that
  depends on whether the hop stays inside a node or crosses the network.  LL128 and NVLS are not modelled.
  As in NCCL, LL's bus bandwidth is also capped: ``ll_max_bw_intra_gbps`` for a group inside one node,
  ``ll_max_bw_inter_gbps`` for a group spanning nodes (0: no cap).  ``net_overhead_us``: NCCL's host cost of
  posting one network operation; a ring spanning nodes pays at least that per step (Simple three times).
* Floors measured by nccl-tests (wall time over back-to-back calls), 0 for none: ``collective_floor_us``, the
  shortest time of one call, ``max(floor, latency + size / bandwidth)`` (the transfer hides under it);
  ``inter_node_latency_floor_us``, the smallest latency of a collective spanning nodes,
  ``max(floor, latency) + size / bandwidth`` (the transfer adds to it).
* Compute: dense peak TFLOP/s per dtype, memory bandwidth in GB/s and a fixed per-kernel overhead in µs;
  ``matmul_fixed_us`` is what a kernel doing FLOPs (matrix multiply, attention, convolution) costs on top:
  filling and draining its pipeline of tiles, which a large GEMM hides and a small one does not (0: none).
* ``collective_library`` says which algorithms run: ``"nccl"`` (ring / tree, LL / Simple, the fastest wins)
  or ``"gloo"`` (ring only; gloo's tensor reduce-scatter runs a full ring all-reduce and keeps one chunk).
* ``small_collective_bands``: measured prices of small ring collectives (all-gather, reduce-scatter,
  all-reduce), for links where the α–β line does not hold at small sizes (a host's per-call cost and
  scheduling, a traffic shaper's burst that lets small messages through faster than the rate).  A tuple of
  bands ``(max_bytes, call_us, step_us)``, ascending in ``max_bytes``; a call whose full payload is at most a
  band's ``max_bytes`` (the first such band) takes ``call_us + (steps − 1) · step_us``, transfer included:
  ``call_us`` is a call of one ring step (the per-call floor), ``step_us`` every further step, ``steps`` the
  call's ring steps (``n−1``; an all-reduce, and gloo's reduce-scatter, ``2(n−1)``); larger calls are priced
  by the α–β model.  ``call_us`` and ``step_us`` never decrease from one band to the next, so more
  bytes never cost less inside the bands.  Empty (the default): no bands.
* ``small_collective_extra_us``: per op (``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``), the µs a
  banded call of that op costs beyond its band price: the host work one op does around the ring of the
  others with its step count (gloo's reduce-scatter copies the chunks around a full all-reduce).  ``(op,
  µs)`` pairs (a JSON object or list of pairs), non-negative; an op not named costs nothing extra.  Both
  fields are fitted from a measured sweep by ``fit_small_collectives`` (``cost_model.bands``).
* Overlap costs: ``collective_issue_us`` is the host time the compute stream spends issuing one collective
  (the device cannot start what the host has not issued); ``compute_slowdown_during_comm`` is how much longer
  compute takes while a collective runs on the same device (0.3: 30 % longer), from shared SMs and memory
  bandwidth on a GPU, shared cores and memory on a CPU.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from typing import Any, Mapping, Union

from ..dag.collectives import KINDS

__all__ = [
    "BAND_OPS",
    "ClusterProfile",
    "available_profiles",
    "load_profile",
    "profile_from_mapping",
]


@dataclass(frozen=True)
class ClusterProfile:
    """Hardware numbers of one cluster type; see the module docstring for units and conventions."""

    name: str
    gpus_per_node: int
    intra_node_bw_gbps: float
    inter_node_bw_per_nic_gbps: float
    nics_per_node: int
    ring_base_latency_simple_us: float
    ring_base_latency_ll_us: float
    tree_base_latency_simple_us: float
    tree_base_latency_ll_us: float
    intra_hop_latency_simple_us: float
    intra_hop_latency_ll_us: float
    inter_hop_latency_simple_us: float
    inter_hop_latency_ll_us: float
    ll_bandwidth_fraction: float
    tree_bandwidth_fraction: float
    tflops_float32: float
    tflops_bfloat16: float
    tflops_float16: float
    mem_bw_gbps: float
    kernel_launch_us: float
    description: str = ""
    collective_library: str = "nccl"
    collective_issue_us: float = 0.0
    compute_slowdown_during_comm: float = 0.0
    ll_max_bw_intra_gbps: float = 0.0
    ll_max_bw_inter_gbps: float = 0.0
    collective_floor_us: float = 0.0
    inter_node_latency_floor_us: float = 0.0
    net_overhead_us: float = 0.0
    matmul_fixed_us: float = 0.0
    small_collective_bands: tuple[tuple[int, float, float], ...] = ()
    small_collective_extra_us: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        _validate(self)
        # one order for the pairs, so that equal prices make equal (and equally hashed) profiles
        object.__setattr__(self, "small_collective_extra_us", tuple(sorted(self.small_collective_extra_us)))

    def replace(self, **changes: Any) -> "ClusterProfile":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; ``profile_from_mapping(p.to_dict()) == p``."""
        return dataclasses.asdict(self)


_INT_FIELDS = ("gpus_per_node", "nics_per_node")
_FRACTION_FIELDS = ("ll_bandwidth_fraction", "tree_bandwidth_fraction")
_STR_FIELDS = ("name", "description", "collective_library")
_BAND_FIELDS = ("small_collective_bands", "small_collective_extra_us")
#: the collectives a band prices: ring collectives with a step count
BAND_OPS = tuple(op.value for op, kind in KINDS.items() if "ring" in kind.algorithms and kind.ring_passes is not None)
_NON_NEGATIVE_FIELDS = (
    "collective_issue_us",
    "compute_slowdown_during_comm",
    "ll_max_bw_intra_gbps",
    "ll_max_bw_inter_gbps",
    "collective_floor_us",
    "inter_node_latency_floor_us",
    "net_overhead_us",
    "matmul_fixed_us",
)
COLLECTIVE_LIBRARIES = ("nccl", "gloo")
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(ClusterProfile))
_REQUIRED = tuple(
    f.name for f in dataclasses.fields(ClusterProfile) if f.default is dataclasses.MISSING and f.name != "name"
)
# everything else must be a positive finite number
_POSITIVE_FIELDS = tuple(
    n for n in _FIELD_NAMES
    if n not in _INT_FIELDS + _FRACTION_FIELDS + _STR_FIELDS + _NON_NEGATIVE_FIELDS + _BAND_FIELDS
)
_BAND_EXPECTED = ("(max_bytes, call_us, step_us) triples, max_bytes a positive integer and strictly increasing, "
                  "call_us and step_us non-negative and never decreasing from one band to the next")


def _band_problem(bands: Any) -> str | None:
    """Why ``bands`` is not a valid ``small_collective_bands`` value, or None."""
    if not isinstance(bands, tuple):
        return "not a tuple"
    previous = None
    for i, band in enumerate(bands):
        if not isinstance(band, tuple) or len(band) != 3:
            return f"band {i} is not a (max_bytes, call_us, step_us) triple"
        max_bytes, call_us, step_us = band
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            return f"band {i}: max_bytes={max_bytes!r} is not a positive integer"
        for what, v in (("call_us", call_us), ("step_us", step_us)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                return f"band {i}: {what}={v!r} is not a non-negative finite number"
        if previous is not None:
            if max_bytes <= previous[0]:
                return f"band {i}: max_bytes={max_bytes} does not exceed band {i - 1}'s {previous[0]}"
            if call_us < previous[1] or step_us < previous[2]:
                return (f"band {i}: call_us, step_us ({call_us}, {step_us}) below band {i - 1}'s "
                        f"({previous[1]}, {previous[2]})")
        previous = band
    return None


_EXTRA_EXPECTED = f"(op, µs) pairs, op one of {', '.join(BAND_OPS)} at most once, µs a non-negative finite number"


def _extra_problem(extra: Any) -> str | None:
    """Why ``extra`` is not a valid ``small_collective_extra_us`` value, or None."""
    if not isinstance(extra, tuple) or not all(isinstance(e, tuple) and len(e) == 2 for e in extra):
        return "not a tuple of pairs"
    ops = [op for op, _ in extra]
    for op, us in extra:
        if not isinstance(op, str) or op not in BAND_OPS or ops.count(op) > 1:
            return f"op {op!r} unknown or repeated"
        if isinstance(us, bool) or not isinstance(us, (int, float)) or not math.isfinite(us) or us < 0:
            return f"{op}: {us!r} is not a non-negative finite number"
    return None


def _validate(p: ClusterProfile) -> None:
    def bad(field: str, expected: str) -> ValueError:
        return ValueError(
            f"cluster profile {p.name!r}: {field}={getattr(p, field)!r} is not valid, expected {expected}"
        )

    for f in _STR_FIELDS:
        if not isinstance(getattr(p, f), str):
            raise bad(f, "a string")
    if not p.name:
        raise bad("name", "a non-empty string")
    for f in _INT_FIELDS:
        v = getattr(p, f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad(f, "an integer >= 1")
    for f in _POSITIVE_FIELDS:
        v = getattr(p, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise bad(f, "a positive finite number")
    for f in _NON_NEGATIVE_FIELDS:
        v = getattr(p, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise bad(f, "a non-negative finite number")
    problem = _band_problem(p.small_collective_bands)
    if problem is not None:
        raise ValueError(f"cluster profile {p.name!r}: small_collective_bands={p.small_collective_bands!r} is not "
                         f"valid ({problem}), expected {_BAND_EXPECTED}")
    problem = _extra_problem(p.small_collective_extra_us)
    if problem is not None:
        raise ValueError(f"cluster profile {p.name!r}: small_collective_extra_us={p.small_collective_extra_us!r} is "
                         f"not valid ({problem}), expected {_EXTRA_EXPECTED}")
    if p.collective_library not in COLLECTIVE_LIBRARIES:
        raise bad("collective_library", f"one of {', '.join(map(repr, COLLECTIVE_LIBRARIES))}")
    v = p.ll_bandwidth_fraction
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise bad("ll_bandwidth_fraction", "a number in [0, 1] (0 disables the LL protocol)")
    v = p.tree_bandwidth_fraction
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise bad("tree_bandwidth_fraction", "a number in (0, 1]")


def _profiles_dir():
    return resources.files(__package__).joinpath("profiles")


@functools.lru_cache(maxsize=None)
def _shipped() -> dict[str, str]:
    """name -> JSON text of every shipped profile."""
    out: dict[str, str] = {}
    for entry in _profiles_dir().iterdir():
        if entry.name.endswith(".json"):
            out[entry.name[: -len(".json")]] = entry.read_text(encoding="utf-8")
    return out


def available_profiles() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(_shipped())


@functools.lru_cache(maxsize=None)
def _load_shipped(name: str) -> ClusterProfile:
    text = _shipped()[name]
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:  # a packaging error, not a user error
        raise ValueError(f"shipped cluster profile {name}.json is not valid JSON: {exc}") from None
    if data.get("name", name) != name:
        raise ValueError(f"shipped cluster profile {name}.json names itself {data.get('name')!r}")
    data["name"] = name
    return _from_complete_mapping(data, where=f"profile {name!r}")


def _unknown_name(name: str) -> ValueError:
    if name.endswith(".json") or os.sep in name:  # meant as a file
        return ValueError(f"cluster profile file {name}: no such file")
    names = available_profiles()
    close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ValueError(
        f"unknown cluster profile {name!r}{hint}: expected one of {', '.join(names)} "
        "(or a profile JSON file, or a mapping of profile values)"
    )


def _coerce(field: str, value: Any, where: str) -> Any:
    """JSON gives ints for whole floats and floats for ints: make numbers fit the field's type."""
    if field in _STR_FIELDS:
        return value
    if field == "small_collective_extra_us":
        # a JSON object {op: µs} or a list of [op, µs] pairs becomes a tuple of pairs (validated by the profile)
        pairs = list(value.items()) if isinstance(value, Mapping) else value
        if not isinstance(pairs, (list, tuple)) or not all(isinstance(e, (list, tuple)) and len(e) == 2
                                                            for e in pairs):
            raise ValueError(f"{where}: {field}={value!r} is not valid, expected {_EXTRA_EXPECTED}")
        return tuple((op, float(us) if isinstance(us, int) and not isinstance(us, bool) else us) for op, us in pairs)
    if field in _BAND_FIELDS:
        # JSON gives lists: a list of [max_bytes, call_us, step_us] lists becomes a tuple of triples
        if not isinstance(value, (list, tuple)) or not all(isinstance(b, (list, tuple)) and len(b) == 3
                                                           for b in value):
            raise ValueError(f"{where}: {field}={value!r} is not valid, expected {_BAND_EXPECTED}")
        out = []
        for b in value:
            max_bytes, call_us, step_us = b
            if (isinstance(max_bytes, (int, float)) and not isinstance(max_bytes, bool)
                    and math.isfinite(max_bytes) and float(max_bytes) == int(max_bytes)):
                max_bytes = int(max_bytes)
            out.append((max_bytes, *(float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                                     for v in (call_us, step_us))))
        return tuple(out)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {field}={value!r} is not valid, expected a number")
    if field in _INT_FIELDS:
        if float(value) != int(value):
            raise ValueError(f"{where}: {field}={value!r} is not valid, expected an integer")
        return int(value)
    return float(value)


def _from_complete_mapping(data: Mapping[str, Any], where: str) -> ClusterProfile:
    unknown = sorted(set(data) - set(_FIELD_NAMES))
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; expected fields: {', '.join(_FIELD_NAMES)}"
        )
    missing = [f for f in _REQUIRED if f not in data]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)} (or give \"base\": a shipped profile name)")
    values = {k: _coerce(k, v, where) for k, v in data.items()}
    values.setdefault("name", "custom")
    return ClusterProfile(**values)


def profile_from_mapping(mapping: Mapping[str, Any]) -> ClusterProfile:
    """A user-defined profile.

    Either every field is given, or ``"base": "<shipped name>"`` names a profile whose fields the mapping
    overrides.  The name defaults to ``"<base>+custom"`` (or ``"custom"``) so a modified profile is never
    mistaken for a shipped one.
    """
    if not isinstance(mapping, Mapping):
        raise ValueError(f"cluster profile: expected a mapping of profile values, got {type(mapping).__name__}")
    data = dict(mapping)
    base = data.pop("base", None)
    if base is None:
        return _from_complete_mapping(data, where="cluster profile mapping")
    if not isinstance(base, str):
        raise ValueError(f"cluster profile mapping: base={base!r} is not valid, expected a shipped profile name")
    if base not in _shipped():
        raise _unknown_name(base)
    merged = _load_shipped(base).to_dict()
    merged["name"] = f"{base}+custom"
    merged.update(data)
    return _from_complete_mapping(merged, where=f"cluster profile mapping (base {base!r})")


def load_profile(name_or_mapping: Union[str, Mapping[str, Any], ClusterProfile, os.PathLike]) -> ClusterProfile:
    """A shipped profile by name, a mapping (see ``profile_from_mapping``), a profile, or a JSON file path."""
    if isinstance(name_or_mapping, ClusterProfile):
        return name_or_mapping
    if isinstance(name_or_mapping, Mapping):
        return profile_from_mapping(name_or_mapping)
    if isinstance(name_or_mapping, (str, os.PathLike)):
        name = os.fspath(name_or_mapping)
        if name in _shipped():
            return _load_shipped(name)
        if name.endswith(".json") and os.path.isfile(name):
            try:
                with open(name, encoding="utf-8") as fh:
                    data = json.load(fh)
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"cluster profile file {name}: cannot read it as JSON ({exc})") from None
            return profile_from_mapping(data)
        raise _unknown_name(name)
    raise ValueError(
        f"cluster: expected a profile name, a mapping or a ClusterProfile, got {type(name_or_mapping).__name__}"
    )
