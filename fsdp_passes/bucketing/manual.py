"""Manual bucket plans: module FQN patterns, as users write them for transformers.

``["tok_embeddings", "layers.[0-31]", ["norm", "output"]]``:

* a string is one bucket; a numeric range ``[a-b]`` (or list ``[0,2,5]``) inside it expands to one bucket per
  value (``layers.0`` ... ``layers.31``);
* a nested list is one bucket holding everything its patterns match (ranges inside it stay in that bucket);
* a pattern matches a collective whose FQN equals it or starts with ``pattern + "."``; ``*`` and ``?``
  wildcards work as in ``fnmatch`` (``"layers.*.attention"``).

A collective is matched by its parameter's FQN when the graph records it (``meta["custom"]["fsdp_param"]``,
written by this package's frontend or, for any frontend, by the pre-grad pass from Dynamo's parameter
sources; or ``param_fqns`` mapping the gathered placeholder's name to the parameter FQN) and by the module
that ran it (``nn_module_stack``, ``fwd_nn_module_stack`` in backward; torchtitan's ``module_fqn``
annotation).  Both are in the naming of the module given to ``torch.compile``.  The first entry (in plan
order) that matches either name claims the collective.

Each entry gives one bucket per (op, process group, reduce op, dtype): the forward all-gathers, backward
re-gathers and gradient reduce-scatters of a layer are separate buckets, as are bf16 gathers and fp32 ones.
"""

from __future__ import annotations

import fnmatch
import itertools
import re
from typing import Mapping, Sequence, Union

from ..dag.graph import Dag, DagNode
from .plan import (Bucket, BucketPlanResult, CollectiveSurvey, bucket_key, make_bucket, param_name, split_dependent,
                   surveyed)

PlanEntry = Union[str, Sequence[str]]

_RANGE_RE = re.compile(r"\[\s*(\d+)\s*-\s*(\d+)\s*\]|\[\s*(\d+(?:\s*,\s*\d+)*)\s*\]")

PATTERN_SYNTAX = (
    "module FQN patterns such as 'layers.0', 'layers.[0-3]' (a range a <= b: one bucket per value), "
    "'layers.[0,2,5]' (a list of values), '*' and '?' wildcards ('layers.*.attention'), or a list of "
    "patterns for one bucket"
)


class UnmatchedPlanEntry(ValueError):
    """A ``bucket_plan`` entry matched no bucketable collective of the graph."""

    def __init__(self, entries: list[str], detail: str = "") -> None:
        self.entries = entries
        shown = describe_entries(entries)
        super().__init__(f"bucket_plan entr{'y' if len(entries) == 1 else 'ies'} {shown} matched no bucketable "
                         f"collective of this graph{detail}")


def describe_entries(entries: list[str], limit: int = 8) -> str:
    """``'a', 'b', ... and 12 more`` for messages."""
    shown = ", ".join(repr(e) for e in entries[:limit])
    return shown + (f" and {len(entries) - limit} more" if len(entries) > limit else "")


def fqns_seen_hint(fqns: list[str], limit: int = 6) -> str:
    """`` (FQNs seen: a, b, ...)`` for messages about plan entries that matched nothing."""
    if not fqns:
        return " (no collective of this graph records a parameter or module FQN)"
    return f" (FQNs seen: {', '.join(fqns[:limit])}{', ...' if len(fqns) > limit else ''})"


def expand_pattern(pattern: str) -> list[str]:
    """``"layers.[0-2].attn"`` -> ``["layers.0.attn", "layers.1.attn", "layers.2.attn"]``; no range: itself.

    Brackets hold only a numeric range or list: any other bracket (``[a-b]``, ``[``, ``[0-]``, ``[]``) is a
    ValueError naming the pattern and ``PATTERN_SYNTAX``.
    """
    pieces: list[list[str]] = []
    pos = 0
    for m in _RANGE_RE.finditer(pattern):
        _check_no_brackets(pattern, pattern[pos : m.start()])
        pieces.append([pattern[pos : m.start()]])
        if m.group(1) is not None:
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise ValueError(f"bucket_plan pattern {pattern!r}: range [{lo}-{hi}] is empty; "
                                 f"expected {PATTERN_SYNTAX}")
            pieces.append([str(v) for v in range(lo, hi + 1)])
        else:
            pieces.append([v.strip() for v in m.group(3).split(",")])
        pos = m.end()
    _check_no_brackets(pattern, pattern[pos:])
    pieces.append([pattern[pos:]])
    return ["".join(parts) for parts in itertools.product(*pieces)]


def _check_no_brackets(pattern: str, text: str) -> None:
    if "[" in text or "]" in text:
        raise ValueError(f"bucket_plan pattern {pattern!r}: a bracket must hold a numeric range [a-b] or a "
                         f"list [a,b,...]; expected {PATTERN_SYNTAX}")


def expand_plan(bucket_plan: Sequence[PlanEntry]) -> list[tuple[str, list[str]]]:
    """Plan entries -> ``[(label, patterns)]``, one item per bucket-to-be, in plan order."""
    if isinstance(bucket_plan, str) or not isinstance(bucket_plan, Sequence) or not bucket_plan:
        raise ValueError(f"bucket_plan={bucket_plan!r}: expected a non-empty list of FQN patterns or lists of them")
    out: list[tuple[str, list[str]]] = []
    for entry in bucket_plan:
        if isinstance(entry, str):
            if not entry:
                raise ValueError(f"bucket_plan: empty pattern; expected {PATTERN_SYNTAX}")
            out.extend((p, [p]) for p in expand_pattern(entry))
        elif isinstance(entry, Sequence) and entry and all(isinstance(p, str) and p for p in entry):
            patterns = [p for e in entry for p in expand_pattern(e)]
            out.append(("[" + ", ".join(entry) + "]", patterns))
        else:
            raise ValueError(f"bucket_plan entry {entry!r}: expected a pattern string or a non-empty list of them")
    return out


def matches(fqn: str, pattern: str) -> bool:
    """``fqn`` is ``pattern``, lies under it (``pattern + "."`` prefix), or fnmatch-matches it (or under it)."""
    if fqn == pattern or fqn.startswith(pattern + "."):
        return True
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(fqn, pattern) or fnmatch.fnmatchcase(fqn, pattern + ".*")
    return False


class _Matcher:
    """First plan entry matching an FQN, in O(FQN depth + number of wildcard patterns) per lookup."""

    def __init__(self, entries: list[tuple[str, list[str]]]) -> None:
        self.exact: dict[str, int] = {}
        self.wild: list[tuple[int, str]] = []
        for k, (_, patterns) in enumerate(entries):
            for p in patterns:
                if any(ch in p for ch in "*?["):
                    self.wild.append((k, p))
                else:
                    self.exact.setdefault(p, k)

    def __call__(self, fqn: str) -> int | None:
        best = None
        parts = fqn.split(".")
        for i in range(1, len(parts) + 1):  # fqn itself and every dotted prefix of it
            k = self.exact.get(".".join(parts[:i]))
            if k is not None and (best is None or k < best):
                best = k
        for k, p in self.wild:
            if best is not None and k >= best:
                break
            if matches(fqn, p):
                best = k
                break
        return best


def collective_fqn(node: DagNode, param_fqns: Mapping[str, str] | None = None) -> str | None:
    """The collective's FQN for blocks and reports: the parameter's when known, else the module's."""
    names = collective_names(node, param_fqns)
    return names[0] if names else None


def collective_names(node: DagNode, param_fqns: Mapping[str, str] | None = None) -> list[str]:
    """Every FQN a plan pattern may match a collective by: its parameter's, then the module that ran it
    (they differ for a tied parameter, gathered again in a module that does not own it)."""
    names: list[str] = []
    name = param_name(node)
    if not name and param_fqns and node.param_fqn and node.param_fqn in param_fqns:
        name = param_fqns[node.param_fqn]
    if name:
        names.append(name)
    module = node.module_fqn
    if module and not (name and (name == module or name.startswith(module + "."))):
        names.append(module)
    return names


def plan_manual(
    dag: Dag,
    bucket_plan: Sequence[PlanEntry],
    *,
    bucket_non_fsdp: bool = False,
    param_fqns: Mapping[str, str] | None = None,
    strict: bool = True,
    survey: CollectiveSurvey | None = None,
) -> BucketPlanResult:
    """Buckets from ``bucket_plan`` (see the module docstring).  ``survey``: ``dag``'s collectives judged with
    ``bucket_non_fsdp`` (``survey_collectives``), if the caller has them.

    An entry that matches no bucketable collective raises ``UnmatchedPlanEntry`` (a ``ValueError`` naming it)
    when ``strict``; otherwise it is listed in the result's ``unmatched_entries``.  Collectives no entry
    matches stay alone, with the reason in ``unbucketed``.
    """
    entries = expand_plan(bucket_plan)
    match = _Matcher(entries)
    survey = surveyed(dag, bucket_non_fsdp, survey)
    collectives = survey.collectives
    unbucketed: dict[int, str] = {}
    claimed: list[list[int]] = [[] for _ in entries]
    for c in collectives:
        why = survey.unbucketed.get(c)
        if why:
            unbucketed[c] = why
            continue
        names = collective_names(dag.nodes[c], param_fqns)
        if not names:
            unbucketed[c] = "no parameter or module FQN recorded on the node: no plan entry can match it"
            continue
        found = [k for k in map(match, names) if k is not None]
        if not found:
            unbucketed[c] = f"{' / '.join(names)}: not matched by any bucket_plan entry"
        else:
            claimed[min(found)].append(c)

    missing = [label for (label, _), members in zip(entries, claimed) if not members]
    known: list[str] = []
    if missing:
        known = sorted({f for c in collectives if (f := collective_fqn(dag.nodes[c], param_fqns))})
        if strict:
            raise UnmatchedPlanEntry(missing, fqns_seen_hint(known))

    buckets: list[Bucket] = []
    for (label, _), members in zip(entries, claimed):
        by_key: dict[tuple, list[int]] = {}
        for c in members:
            by_key.setdefault(bucket_key(dag.nodes[c]), []).append(c)
        # several dtypes of the same (op, group, reduce op) inside one entry: one bucket per dtype
        per_op: dict[tuple, int] = {}
        for key in by_key:
            per_op[(key[0], key[1], key[2])] = per_op.get((key[0], key[1], key[2]), 0) + 1
        for key, ms in by_key.items():
            runs = split_dependent(dag, ms)
            for r_idx, run in enumerate(runs):
                if r_idx < len(runs) - 1:
                    reason = "dependency"
                elif per_op[(key[0], key[1], key[2])] > 1:
                    reason = "dtype"
                else:
                    reason = "plan"
                buckets.append(make_bucket(dag, run, close_reason=reason, label=label))
    buckets.sort(key=lambda b: b.members[0])
    return BucketPlanResult(buckets=buckets, unbucketed=unbucketed, n_collectives_before=len(collectives),
                            unmatched_entries=missing, fqns_seen=known)
