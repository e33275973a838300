"""The check across ranks at a compiled graph's first run (``enable(check_ranks=True)``).

The FX pass puts one call of ``fsdp_passes::check_ranks`` at the top of every graph with collectives; its
arguments are constants: the graph's name and its final collective sequence per process group (JSON).  Being
part of the graph, it comes back with every FX-graph-cache and AOT-autograd-cache hit.  When the call runs on a
rank for a sequence that rank has not checked yet, the rank publishes the sequence in the default process
group's c10d store and waits (``store.wait`` with a timeout, never a collective: it cannot hang, nor disturb a
communication stream) until every rank sharing one of its process groups has published a graph with the same
sequence on the groups they share.  Later runs return after one set look-up.

Pairing is by content, not by position: a rank that recompiled a graph alone (its shapes changed, the peer's
did not) is compared with every graph the peer has published, so a recompile that keeps the sequence costs no
wait.  A mismatch is raised at once when the peer is itself blocked in a check on a graph of another sequence
(both ranks are about to issue different collectives: the usual case, found on every rank at the same time);
otherwise the rank waits for the peer's next graph until the timeout, and then raises: the peer runs a graph
whose collectives differ, or never arrives.  A rank that raises leaves a note in the store; ranks still
waiting in a check raise with its message.
"""

from __future__ import annotations

import json
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.fx as fx

from ..debug.consistency import LIKELY_CAUSES, first_collective_difference, per_group_sequences

__all__ = ["RankMismatch", "RankChecker", "CHECK_OP", "insert_rank_check", "is_rank_check"]

_KEY = "fsdp_passes/check_ranks/"
_POLL_S = 5.0  # how often a waiting rank looks for another rank's abort note


class RankMismatch(RuntimeError):
    """Ranks compiled graphs whose collectives differ (they would hang), or a rank never reached the check."""


# the op's schema and its fake (shape-only) version; the installation that owns the ``RankChecker`` registers
# what it does at run time (``install.py``), so that this module needs nothing above it
_LIBRARY = torch.library.Library("fsdp_passes", "FRAGMENT")
_LIBRARY.define("check_ranks(str graph, str sequences, float timeout_s) -> ()")
torch.library.register_fake("fsdp_passes::check_ranks", lambda graph, sequences, timeout_s: None, lib=_LIBRARY)

CHECK_OP = torch.ops.fsdp_passes.check_ranks.default
# no outputs: without this FX's and Inductor's dead-code elimination drop the call (``FallbackKernel.
# has_side_effects`` and ``Node.is_impure`` both read this registry)
fx.node.has_side_effect(CHECK_OP)


def is_rank_check(snode: Any) -> bool:
    """Whether an Inductor scheduler node is the check's call (the scheduler pass puts it first)."""
    return getattr(getattr(snode, "node", None), "op_overload", None) is CHECK_OP


def insert_rank_check(graph: fx.Graph, graph_name: str, timeout_s: float | None) -> bool:
    """Put the check's call at the top of ``graph`` (after its inputs) with its final per-group collective
    sequences; nothing when the graph has no collective.  Returns whether a call was inserted."""
    from ..dag.from_fx import dag_from_fx
    from ..pipeline.report import collective_sequence

    sequences = per_group_sequences(collective_sequence(dag_from_fx(graph)))
    if not sequences:
        return False
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    insert = graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(next(iter(graph.nodes)))
    with insert:
        graph.call_function(CHECK_OP, (graph_name, json.dumps(sequences, sort_keys=True),
                                       -1.0 if timeout_s is None else float(timeout_s)))
    return True


class RankChecker:
    """This process's side of the check: which sequences passed (for the default process group's store in
    use), and what the other ranks have published so far."""

    def __init__(self) -> None:
        self._store_ref: Any = None
        self._passed: set[str] = set()
        self._peer_entries: dict[int, list[dict[str, Any]]] = {}

    @property
    def checked(self) -> int:
        """How many distinct graph sequences passed the check with the current default process group."""
        return len(self._passed)

    def check(self, graph: str, sequences: str, timeout_s: float) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        if self._store_ref is None or self._store_ref() is not store:  # a new process group: a new store
            self._store_ref = weakref.ref(store)
            self._passed = set()
            self._peer_entries = {}
        if sequences in self._passed:
            return
        if dist.get_world_size() == 1 or dist.get_backend() == "fake":
            self._passed.add(sequences)
            return
        self._check_once(store, graph, json.loads(sequences), timeout_s)
        self._passed.add(sequences)

    def _check_once(self, store: Any, graph: str, sequences: dict[str, list[str]], timeout_s: float) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        me = dist.get_rank()
        groups = {name: sorted(dist.get_process_group_ranks(_resolve_process_group(name))) for name in sequences}
        if timeout_s < 0:  # the default process group's own timeout: a collective would wait that long too
            timeout_s = _default_timeout_s()
        index = int(store.add(f"{_KEY}n/{me}", 1)) - 1
        store.set(f"{_KEY}e/{me}/{index}", json.dumps({"graph": graph, "groups": groups, "seq": sequences}))
        deadline = time.monotonic() + timeout_s
        peers = sorted({r for ranks in groups.values() for r in ranks if r != me})
        try:
            for peer in peers:
                shared = {g: sequences[g] for g, ranks in groups.items() if peer in ranks}
                self._wait_for_match(store, graph, me, peer, shared, deadline, timeout_s)
        except RankMismatch as exc:
            store.set(f"{_KEY}abort", f"rank {me}: {exc}")
            raise
        store.set(f"{_KEY}ok/{me}/{index}", "1")

    def _wait_for_match(self, store: Any, graph: str, me: int, peer: int, mine: dict[str, list[str]],
                        deadline: float, timeout_s: float) -> None:
        import torch.distributed as dist

        entries = self._peer_entries.setdefault(peer, [])
        while True:
            count = int(store.add(f"{_KEY}n/{peer}", 0))
            while len(entries) < count:
                entries.append(json.loads(store.get(f"{_KEY}e/{peer}/{len(entries)}")))
            if any(_agrees(mine, entry) for entry in entries):
                return
            if entries and not store.check([f"{_KEY}ok/{peer}/{count - 1}"]):
                # the peer is blocked in a check on its newest graph, which it is about to run: a real mismatch
                raise RankMismatch(_mismatch_text(graph, me, peer, mine, entries[-1], waited=None))
            if store.check([f"{_KEY}abort"]):
                raise RankMismatch(f"fsdp_passes: another rank found a mismatch: {store.get(f'{_KEY}abort').decode()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankMismatch(_mismatch_text(graph, me, peer, mine, entries[-1] if entries else None,
                                                  waited=timeout_s))
            try:
                store.wait([f"{_KEY}e/{peer}/{count}"], timedelta(seconds=min(left, _POLL_S)))
            except dist.DistStoreError as exc:  # a timeout of this slice: look again
                if "timeout" not in str(exc).lower():
                    raise


def _default_timeout_s() -> float:
    from torch.distributed.distributed_c10d import _get_default_group

    try:
        backend = _get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except Exception:  # another backend: torch's default collective timeout
        from torch.distributed.constants import default_pg_timeout

        return default_pg_timeout.total_seconds()


def _agrees(mine: dict[str, list[str]], entry: dict[str, Any]) -> bool:
    return all(entry["seq"].get(group) == seq for group, seq in mine.items())


def _flat(sequences: dict[str, list[str]]) -> list[str]:
    return [item for group in sorted(sequences) for item in sequences[group]]


def _mismatch_text(graph: str, me: int, peer: int, mine: dict[str, list[str]], theirs: dict[str, Any] | None,
                   waited: float | None) -> str:
    if theirs is None:
        return (f"fsdp_passes: rank {me} waited {waited:.0f} s at the first run of graph {graph!r} for rank {peer}, "
                f"which compiled no graph with collectives on the process groups they share "
                f"({', '.join(sorted(mine))}): it never arrived (it is stuck, crashed, or runs other code). "
                f"Likely causes: {LIKELY_CAUSES}.")
    their_seq = {g: theirs["seq"].get(g, []) for g in mine}
    found = first_collective_difference(_flat(mine), _flat(their_seq))
    if found is None:  # cannot happen when they disagree; said plainly rather than asserted
        where = "their collective sequences differ"
    else:
        group, j, a, b = found
        ranks = theirs.get("groups", {}).get(group)
        where = (f"process group {group!r}" + (f" (ranks {ranks})" if ranks else "")
                 + f": collective #{j} is '{a}' on rank {me} but '{b}' on rank {peer}")
    lead = (f"fsdp_passes: ranks {me} and {peer} compiled graphs that issue different collectives and would hang: "
            f"graph {graph!r} on rank {me}, graph {theirs['graph']!r} on rank {peer}")
    if waited is not None:
        lead += f" (the newest rank {peer} had after {waited:.0f} s of waiting)"
    return f"{lead}; {where}. Likely causes: {LIKELY_CAUSES}."
