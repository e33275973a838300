"""``verify_rank_consistency``: check that every rank compiled the same collective sequences.

Ranks whose compiled graphs issue different collectives (another bucketing, another order inside a process
group) hang at the first mismatching collective.  Each pass report carries a fingerprint of the final
per-process-group collective sequences (``GraphReport.collective_fingerprint``) and the readable sequence
(``report.extra["collective_sequence"]``); this gathers them from every rank once, after compiling and before
the first real step, and names the first graph and collective where ranks disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch.distributed as dist

from ..pipeline.report import GraphReport

__all__ = ["verify_rank_consistency", "rank_entries", "first_difference", "first_collective_difference",
           "per_group_sequences", "LIKELY_CAUSES"]


#: why ranks compile different collective sequences, most likely first (said by every cross-rank check)
LIKELY_CAUSES = ("different local shapes (uneven data, variable sequence lengths, dynamic shapes) that made the "
                 "partitioner or the bucketing decide differently; different fsdp_passes options or calibration "
                 "files per rank; different torch or fsdp_passes versions per rank")


def rank_entries(reports: list[GraphReport]) -> list[tuple[str, str, list[str]]]:
    """This rank's ``(graph, collective_fingerprint, collective_sequence)`` per compiled graph, oldest first.

    A graph's scheduler report (the final order) wins over its FX report (bucketing only: used when the
    scheduler pass did not run on that graph).  Reports of a pass that fell back before simulating carry no
    fingerprint and are skipped.
    """
    chosen: dict[str, GraphReport] = {}
    order: list[str] = []
    for r in reports:
        if not r.collective_fingerprint:
            continue
        if r.graph not in chosen:
            order.append(r.graph)
            chosen[r.graph] = r
        elif r.pass_name == "scheduler" or chosen[r.graph].pass_name != "scheduler":
            chosen[r.graph] = r
    return [(g, chosen[g].collective_fingerprint, list(chosen[g].extra.get("collective_sequence") or []))
            for g in order]


def per_group_sequences(sequence: list[str]) -> dict[str, list[str]]:
    """``collective_sequence`` items split by process group (the second word of each item), issue order kept."""
    groups: dict[str, list[str]] = {}
    for item in sequence:
        parts = item.split(" ")
        groups.setdefault(parts[1] if len(parts) > 1 else "?", []).append(item)
    return groups


def first_difference(a: list[tuple[str, str, list[str]]], b: list[tuple[str, str, list[str]]]) -> Optional[str]:
    """Where two ranks' entries first disagree (``None`` when they agree); ``a`` is the reference rank's."""
    for k in range(max(len(a), len(b))):
        if k >= len(a) or k >= len(b):
            extra = (b if k >= len(a) else a)[k][0]
            who = "the other rank" if k >= len(a) else "the reference rank"
            return f"graph {extra!r} was compiled only by {who} (graph #{k}; the ranks compiled different graphs)"
        (ga, fa, sa), (gb, fb, sb) = a[k], b[k]
        if ga != gb:
            return f"graph #{k} is {ga!r} on the reference rank but {gb!r} on the other (compiled in another order)"
        if fa == fb:
            continue
        found = first_collective_difference(sa, sb)
        if found is not None:
            group, j, ca, cb = found
            return (f"graph {ga!r}, process group {group}: collective #{j} is '{ca}' on the reference rank "
                    f"but '{cb}' on the other (fingerprints {fa} vs {fb})")
        return f"graph {ga!r}: collective fingerprints differ ({fa} vs {fb})"
    return None


def first_collective_difference(a: list[str], b: list[str]) -> Optional[tuple[str, int, str, str]]:
    """The first collective where two ``collective_sequence`` lists disagree, process group by group (groups in
    name order, the order inside a group is the issue order that must match): ``(group, index in the group,
    item of a, item of b)`` with ``"<none>"`` for a missing one; ``None`` when every group's sequence agrees.
    The one rule both ``first_difference`` and the check at a graph's first run
    (``fsdp_passes.inductor.rank_check``) compare ranks by."""
    pa, pb = per_group_sequences(a), per_group_sequences(b)
    for group in sorted(set(pa) | set(pb)):
        xa, xb = pa.get(group, []), pb.get(group, [])
        for j in range(max(len(xa), len(xb))):
            ca = xa[j] if j < len(xa) else "<none>"
            cb = xb[j] if j < len(xb) else "<none>"
            if ca != cb:
                return group, j, ca, cb
    return None


def verify_rank_consistency(reports: list[GraphReport], group: dist.ProcessGroup | None = None) -> None:
    """Raise ``RuntimeError`` if the ranks of ``group`` (default: the world) compiled different collective
    sequences, naming the first differing graph and collective; return ``None`` when all agree.

    Call it on every rank after the first compiled step's compile (it is itself a collective:
    ``all_gather_object`` over ``group``), e.g. after a warm-up step and before training.  It compares the
    ``reports`` (``fsdp_passes.last_reports()``) of each rank with rank 0's (the first rank of ``group``).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("verify_rank_consistency: torch.distributed is not initialised")
    mine = rank_entries(reports)
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    reference = gathered[0]
    for k in range(1, world):
        diff = first_difference(reference, gathered[k])
        if diff is not None:
            raise RuntimeError(
                f"fsdp_passes: ranks {ranks[0]} and {ranks[k]} compiled different collective sequences and would "
                f"hang: {diff.replace('the reference rank', f'rank {ranks[0]}').replace('the other rank', f'rank {ranks[k]}').replace('the other', f'rank {ranks[k]}')}. "
                f"Likely causes: {LIKELY_CAUSES}."
            )
