"""``Options``: every knob of the passes, validated in one place.

Each field can be overridden by an environment variable ``FSDP_PASSES_<FIELD NAME IN CAPITALS>`` read at
``enable()`` time (e.g. ``FSDP_PASSES_BUCKETING=none``, ``FSDP_PASSES_MEMORY_BUDGET=2GB``).  Every value is
checked when it is given: a wrong one is a ``ValueError`` naming the option (or the variable), the value and
what is allowed.  Any other ``FSDP_PASSES_*`` variable is an error naming the closest known one, except the
few that the test harness and benchmarks read (``TOOL_ENV_VARS``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Union

BUCKETING_MODES = ("auto", "manual", "none")
ENV_PREFIX = "FSDP_PASSES_"

BucketPlan = list  # list[str | list[str]]: module FQN patterns, see bucketing.manual

# FSDP_PASSES_* variables that are not options: read by the test suite and the benchmarks, not by enable()
TOOL_ENV_VARS = ("FSDP_PASSES_TEST_CACHE", "FSDP_PASSES_BENCH_NS_PREFIX")


class OptionError(ValueError):
    """A ``ValueError`` about one option; ``option`` names it (so an environment variable can be named)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class Options:
    """What the passes do.  See docs/user-guide.md for each option in full.

    bucketing: "auto" (cost-model planner), "manual" (``bucket_plan``) or "none".
    bucket_plan: module FQN patterns for ``bucketing="manual"``; ``"layers.[0-3]"`` is one bucket per
        layer, a nested list is one bucket.
    bucket_cap_mb: largest bucket the auto planner builds, in MiB of gathered / pre-scatter payload.
    bucket_non_fsdp: also bucket collectives that are not FSDP parameter gathers / gradient reductions.
    reorder: run the scheduling pass (prefetch all-gathers, sink waits).
    cluster: name of a shipped cluster profile, a profile JSON file or a mapping of profile values.
    calibration: path of a JSON calibration table (``python -m fsdp_passes calibrate``); loaded and checked
        when the options are made.
    memory_budget: extra peak memory the passes may add, per graph, over the peak of Inductor's own order of
        the graph without them: bytes (int), a size string with its unit ("512MB", "2GiB", "4096B"; a bare
        "5" is ambiguous and rejected) or a percentage ("5%") of the graph's FSDP payload (gathered
        parameters + gradients to reduce: the same on every rank), or a number of blocks ("2 blocks", the
        default): what one bucket per module block (``layers.<i>``, ...) claims, times the number: one block
        for bucketing and one for the reordering's prefetch, like FSDP2's one-module-ahead prefetch.
    max_prefetch: at most this many collectives of one process group in flight at once (None: no cap).
    debug_dir: write dumps (schedules, buckets, DAG, trace, summary) per compiled graph under this folder.
    strict: raise instead of warning and falling back when a pass fails.
    check_ranks: at each compiled graph's first run, compare its per-process-group collective sequence with
        the other ranks of its groups through the default group's store, and raise ``RankMismatch`` on every
        rank when they differ (they would hang), or on a rank whose peer never arrives.
    check_ranks_timeout_s: how long the check waits for the other ranks, in seconds (None: the default
        process group's timeout, as long as a collective would wait).
    """

    bucketing: str = "auto"
    bucket_plan: BucketPlan | None = None
    bucket_cap_mb: float | None = None
    bucket_non_fsdp: bool = False
    reorder: bool = True
    cluster: Union[str, Mapping[str, Any]] = "h100-nvlink"
    calibration: str | None = None
    memory_budget: Union[int, str] = "2 blocks"
    max_prefetch: int | None = None
    debug_dir: str | None = None
    strict: bool = False
    check_ranks: bool = True
    check_ranks_timeout_s: float | None = None

    def __post_init__(self) -> None:
        _validate(self)

    def replace(self, **changes: Any) -> "Options":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form, stable across runs (used in cache keys and dumps)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Mapping):
                value = dict(sorted(value.items()))
            out[f.name] = value
        return out

    def memory_budget_bytes(self, payload_bytes: int, block_bytes: int) -> int:
        """The budget in bytes; a percentage is of ``payload_bytes``, a number of blocks of ``block_bytes``
        (the passes use the graph's FSDP payload and the memory claim of one bucket per block,
        ``pipeline.budget``: both rank-invariant, unlike any activation-sized peak)."""
        return parse_memory_budget(self.memory_budget, payload_bytes, block_bytes)

    @classmethod
    def from_env(cls, base: "Options | None" = None, environ: Mapping[str, str] | None = None) -> "Options":
        """``base`` with every ``FSDP_PASSES_<OPTION>`` variable applied."""
        environ = os.environ if environ is None else environ
        base = base or cls()
        names = [f.name for f in dataclasses.fields(cls)]
        known = {ENV_PREFIX + n.upper(): n for n in names}
        for key in sorted(environ):
            if key.startswith(ENV_PREFIX) and key not in known and key not in TOOL_ENV_VARS:
                close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]}? " if close else ""
                raise OptionError(key, f"environment variable {key} is not an fsdp_passes option: {hint}known: "
                                 + ", ".join(known))
        changes: dict[str, Any] = {}
        for key, name in known.items():
            if key in environ:
                changes[name] = _parse_env_value(name, environ[key])
        if not changes:
            return base
        try:
            return dataclasses.replace(base, **changes)
        except OptionError as exc:
            if exc.option not in changes:  # a combination: name every variable that took part
                applied = ", ".join(f"{ENV_PREFIX + n.upper()}={environ[ENV_PREFIX + n.upper()]!r}" for n in changes)
                raise OptionError(exc.option, f"{exc} (with the environment variables {applied})") from None
            key = ENV_PREFIX + exc.option.upper()
            raise OptionError(exc.option, f"environment variable {key}={environ[key]!r} is not valid: {exc}") from None


_NUMBER_RE = re.compile(r"^[0-9]*\.?[0-9]+$")  # finite, non-negative: no 'nan', 'inf' or signs
_BLOCKS_RE = re.compile(r"^([0-9]*\.?[0-9]+)\s*blocks?$", re.IGNORECASE)
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,
}


_BUDGET_FORMS = ("bytes as an int (536870912), a size string with a unit ('512MB', '2GiB', '4096B'), a "
                 "percentage of the FSDP payload ('5%') or a number of blocks ('2 blocks', '1 block')")


def parse_memory_budget(value: Union[int, str], payload_bytes: int, block_bytes: int) -> int:
    """``value`` in bytes: a percentage is of ``payload_bytes``, a number of blocks of ``block_bytes``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        _fail("memory_budget", value, _BUDGET_FORMS)
    if isinstance(value, int):
        return value
    text = value.strip()
    if text.endswith("%"):
        number = text[:-1].strip()
        if not _NUMBER_RE.match(number):
            _fail("memory_budget", value, _BUDGET_FORMS)
        return int(float(number) / 100.0 * payload_bytes)
    blocks = _BLOCKS_RE.match(text)
    if blocks:
        return int(float(blocks.group(1)) * block_bytes)
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        _fail("memory_budget", value, _BUDGET_FORMS)
    if not m.group(2):  # "5": bytes? MB? percent? a string needs its unit
        _fail("memory_budget", value, "a unit (a bare number in a string is ambiguous): "
              + _BUDGET_FORMS)
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _fail(option: str, value: Any, allowed: str) -> None:
    raise OptionError(option, f"fsdp_passes option {option}={value!r} is not valid: expected {allowed}")


def _validate(o: Options) -> None:
    if o.bucketing not in BUCKETING_MODES:
        _fail("bucketing", o.bucketing, "one of " + ", ".join(repr(m) for m in BUCKETING_MODES))
    if o.bucket_plan is not None:
        if not isinstance(o.bucket_plan, (list, tuple)) or not o.bucket_plan:
            _fail("bucket_plan", o.bucket_plan, "a non-empty list of module FQN patterns or lists of them")
        from .bucketing.manual import PATTERN_SYNTAX, expand_pattern

        for entry in o.bucket_plan:
            members = entry if isinstance(entry, (list, tuple)) else [entry]
            if not members or not all(isinstance(m, str) and m for m in members):
                _fail("bucket_plan", o.bucket_plan, "entries that are non-empty strings or non-empty lists of strings")
            for pattern in members:
                try:
                    expand_pattern(pattern)
                except ValueError as exc:
                    raise OptionError("bucket_plan", f"fsdp_passes option bucket_plan entry {pattern!r} is not "
                                      f"valid: {exc}") from None
    if o.bucketing == "manual" and not o.bucket_plan:
        _fail("bucket_plan", o.bucket_plan, "a plan (list of module FQN patterns) when bucketing='manual'")
    if o.bucketing != "manual" and o.bucket_plan:
        _fail("bucketing", o.bucketing, "'manual' when a bucket_plan is given")
    if o.bucket_cap_mb is not None and (
        isinstance(o.bucket_cap_mb, bool) or not isinstance(o.bucket_cap_mb, (int, float))
        or not math.isfinite(o.bucket_cap_mb) or o.bucket_cap_mb <= 0
    ):
        _fail("bucket_cap_mb", o.bucket_cap_mb, "a positive number of MiB or None")
    for flag in ("bucket_non_fsdp", "reorder", "strict", "check_ranks"):
        if not isinstance(getattr(o, flag), bool):
            _fail(flag, getattr(o, flag), "True or False")
    if not isinstance(o.cluster, (str, Mapping)):
        _fail("cluster", o.cluster, "a profile name, a profile JSON file or a mapping of profile values")
    from .cost_model.profiles import available_profiles, load_profile

    try:  # the same loader the cost model uses: names, .json files and mappings, checked field by field
        load_profile(o.cluster)
    except (TypeError, ValueError, KeyError) as exc:
        _fail("cluster", o.cluster, "one of " + ", ".join(available_profiles())
              + ", a profile JSON file or a mapping of profile values" + f" ({exc})")
    if o.calibration is not None:
        if not isinstance(o.calibration, (str, os.PathLike)) or not os.path.isfile(o.calibration):
            _fail("calibration", o.calibration, "the path of an existing calibration JSON file")
        from .cost_model.calibration import Calibration

        try:
            Calibration.load(o.calibration)
        except ValueError as exc:
            _fail("calibration", o.calibration,
                  f"a calibration file as 'python -m fsdp_passes calibrate' writes it ({exc})")
    budget = parse_memory_budget(o.memory_budget, 1 << 30, 1 << 30)
    if budget < 0:
        _fail("memory_budget", o.memory_budget, "a budget >= 0")
    if o.max_prefetch is not None and (
        isinstance(o.max_prefetch, bool) or not isinstance(o.max_prefetch, int) or o.max_prefetch < 1
    ):
        _fail("max_prefetch", o.max_prefetch, "an integer >= 1 or None")
    if o.check_ranks_timeout_s is not None and (
        isinstance(o.check_ranks_timeout_s, bool) or not isinstance(o.check_ranks_timeout_s, (int, float))
        or not math.isfinite(o.check_ranks_timeout_s) or o.check_ranks_timeout_s <= 0
    ):
        _fail("check_ranks_timeout_s", o.check_ranks_timeout_s, "a positive number of seconds or None")
    if o.debug_dir is not None and not isinstance(o.debug_dir, (str, os.PathLike)):
        _fail("debug_dir", o.debug_dir, "a folder path or None")
    if o.debug_dir is not None and os.path.exists(o.debug_dir) and not os.path.isdir(o.debug_dir):
        _fail("debug_dir", o.debug_dir, "a folder path or None (this path is a file)")


def _parse_env_value(name: str, text: str) -> Any:
    """Environment values are strings: JSON where it parses (numbers, lists, true/false/null), else text."""
    key = ENV_PREFIX + name.upper()
    if name in ("reorder", "strict", "bucket_non_fsdp", "check_ranks"):
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise OptionError(name, f"environment variable {key}={text!r} is not valid: expected 1/true/yes/on or "
                         "0/false/no/off")
    if name in ("debug_dir", "calibration"):
        return text or None
    if name in ("bucketing", "memory_budget"):  # text as given: "5" stays a string (an ambiguous budget)
        return text
    if name in ("cluster", "bucket_plan") and text.strip()[:1] in ("{", "["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise OptionError(name, f"environment variable {key}={text!r} is not valid JSON ({exc}); expected "
                             + ("a profile name or a JSON object of profile values" if name == "cluster"
                                else "a JSON list of module FQN patterns")) from None
    if name == "cluster":
        return text
    if name == "bucket_plan":
        raise OptionError(name, f"environment variable {key}={text!r} is not valid: expected a JSON list of module FQN "
                         "patterns, e.g. '[\"layers.[0-3]\"]'")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
