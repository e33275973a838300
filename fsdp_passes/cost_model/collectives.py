"""α–β collective times with an NCCL-like choice of algorithm and protocol.

Byte convention (NCCL's): ``nbytes`` is the FULL payload — the gathered output of an all-gather, the
pre-scatter input of a reduce-scatter, the buffer of an all-reduce, the per-rank send buffer of an
all-to-all.  Bandwidths are bus bandwidths, so for a ring

* all-gather / reduce-scatter: ``t = latency + nbytes·(n−1)/n / busbw``
* all-reduce (ring):           ``t = latency + 2·nbytes·(n−1)/n / busbw``
* all-reduce (tree):           ``t = latency + 2·nbytes / (tree_bandwidth_fraction·busbw)``

and latency is a base latency plus one per-hop latency per step, intra-node and inter-node hops priced
separately (a ring all-gather has ``n−1`` steps of which ``nodes−1`` cross the network; an all-reduce twice
that; a ring spanning nodes pays at least ``net_overhead_us`` per step, three times that for Simple, as
NCCL's tuner charges; a tree all-reduce goes up and down ``ranks_per_node−1`` intra hops plus
``ceil(log2 nodes)`` network hops).  Like NCCL's tuner, every enabled (algorithm, protocol) pair is priced
and the fastest wins: Simple has full bandwidth, LL has lower latency and ``ll_bandwidth_fraction`` of the
bandwidth, capped as NCCL caps it (``ll_max_bw_intra_gbps`` inside a node, ``ll_max_bw_inter_gbps`` across
nodes).  Two measured floors bound these times from below (NCCL's tuning latencies rank algorithms; the
smallest calls of the published nccl-tests sweeps take several times as long, docs/design.md): across nodes
every candidate's latency is at least ``inter_node_latency_floor_us`` (the network's per-call latency: the
transfer adds to it), and every collective takes at least ``collective_floor_us`` (back-to-back calls
cannot finish faster than they are issued: the transfer hides under it).

All-to-all is modelled as concurrent pairwise exchanges: one hop of latency of each kind the group spans,
and the slower of the NVLink share (``nbytes·(k−1)/n`` over the intra-node bus) and the network share
(``nbytes·(n−k)/n`` over this rank's share of its node's NICs), where ``k`` is ranks per node.
A group that fills its last node only partly reaches fewer NICs there, so it can be slower than the next
larger group that fills the node: time grows with group size only for evenly filled nodes; latency always
grows with group size.
On a ``"gloo"`` profile only the ring runs (gloo has no tree or LL protocol), and a reduce-scatter is priced as
the ring all-reduce of its full input: ProcessGroupGloo's ``reduce_scatter_tensor_coalesced`` clones the
input, all-reduces it and copies out this rank's chunk, so it moves ``2·nbytes·(n−1)/n``, twice a ring
reduce-scatter (seen on a 400 Mbit/s link, 16 MiB, 2 ranks: all-gather 0.22 s, reduce-scatter 0.36 s,
all-reduce 0.35 s).  A gloo all-gather (``gloo/allgather.cc``: a ring that sends each rank's shard as two
half chunks) pays for one half-shard chunk more than the ring's transfer, less what the sender's socket
takes without waiting (``GLOO_UNBLOCKED_BYTES``): gloo's TCP pair sends a message only after the peer's
ready-to-receive notice, which travels on the same connection behind data, so the rank that enters the call
first writes its first chunk before its own notice reaches the other rank, which starts sending that much
late (measured on the emulated 400 Mbit link, 2 ranks: a 16 MiB all-gather took 258 ms, 1.5x the 168 ms of
8 MiB per direction, and the byte counts show one rank silent for one 4 MiB chunk time; a 1 MiB all-gather's
256 KiB chunks start on time).
A profile with ``small_collective_bands`` prices an all-gather, reduce-scatter or all-reduce whose full
payload is at most a band's ``max_bytes`` from that band instead, whatever the algorithm or protocol:
``call_us + (steps − 1) · step_us``, transfer included, ``steps`` the ring's (``n−1``, an all-reduce
``2(n−1)``, a gloo reduce-scatter as its all-reduce), plus the op's ``small_collective_extra_us``;
``collective_floor_us`` still applies.  Such bands are fitted to a measured sweep where small calls do not
follow the α–β line (``cost_model.bands``).
Any other collective (broadcast, barrier, ...) is priced as a pipelined ring broadcast: ring latency plus
``nbytes / busbw``, charged even for zero bytes (a barrier still costs its latency).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Sequence, Union

from ..dag.collectives import KINDS
from ..dag.graph import CollectiveOp
from .profiles import BAND_OPS, ClusterProfile

__all__ = [
    "CollectiveEstimate",
    "GroupTopology",
    "bus_bandwidth_gbps",
    "collective_ms",
    "estimate_collective",
    "group_topology",
    "normalize_op",
]

_PROTOCOLS = ("simple", "ll")


@dataclass(frozen=True)
class GroupTopology:
    """Where a process group's ranks sit: how many nodes it spans and how its ranks spread over them."""

    size: int
    nodes: int
    max_ranks_per_node: int
    min_nics_per_node: int  # NICs usable by the group on its worst-served node (only meaningful if nodes > 1)


@dataclass(frozen=True)
class CollectiveEstimate:
    """One priced collective: the time and the choice that produced it (for dumps and tests)."""

    ms: float
    algorithm: str  # "ring", "tree", "pairwise" or "none"
    protocol: str  # "simple", "ll", "band" (a measured small_collective_bands price) or "none"
    latency_us: float
    bus_bw_gbps: float


def normalize_op(op: Union[CollectiveOp, str]) -> CollectiveOp:
    """``CollectiveOp`` from an enum member or its value (``"all_gather"``)."""
    if isinstance(op, CollectiveOp):
        return op
    try:
        return CollectiveOp(op)
    except ValueError:
        allowed = ", ".join(repr(o.value) for o in CollectiveOp)
        raise ValueError(f"collective op={op!r} is not valid: expected one of {allowed}") from None


def _check_group(group_size: int, group_ranks: Sequence[int] | None) -> tuple[int, ...] | None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} is not valid: expected an integer >= 1")
    if group_ranks is None:
        return None
    ranks = tuple(group_ranks)
    if len(ranks) != group_size:
        raise ValueError(
            f"group_ranks has {len(ranks)} entries but group_size={group_size}: expected one rank per member"
        )
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"group_ranks={ranks!r} is not valid: expected distinct non-negative integer ranks")
    return ranks


def group_topology(
    profile: ClusterProfile, group_size: int, group_ranks: Sequence[int] | None = None
) -> GroupTopology:
    """Nodes spanned and ranks per node; without ``group_ranks`` the group is taken as contiguous ranks."""
    ranks = _check_group(group_size, group_ranks)
    return _topology(profile, group_size, ranks)


@functools.lru_cache(maxsize=4096)
def _topology(profile: ClusterProfile, group_size: int, ranks: tuple[int, ...] | None) -> GroupTopology:
    gpn = profile.gpus_per_node
    if ranks is None:
        full, rest = divmod(group_size, gpn)
        per_node = [gpn] * full + ([rest] if rest else [])
    else:
        per_node = list(Counter(r // gpn for r in ranks).values())
    nics = min(
        max(1, min(profile.nics_per_node, math.ceil(k * profile.nics_per_node / gpn))) for k in per_node
    )
    return GroupTopology(
        size=group_size, nodes=len(per_node), max_ranks_per_node=max(per_node), min_nics_per_node=nics
    )


def _inter_bw(profile: ClusterProfile, topo: GroupTopology) -> float:
    return profile.inter_node_bw_per_nic_gbps * topo.min_nics_per_node


def bus_bandwidth_gbps(profile: ClusterProfile, topo: GroupTopology) -> float:
    """Bus bandwidth of the slowest link a ring over the group crosses (NVLink inside a node, NICs across)."""
    if topo.nodes == 1:
        return profile.intra_node_bw_gbps
    inter = _inter_bw(profile, topo)
    if topo.max_ranks_per_node > 1:
        return min(profile.intra_node_bw_gbps, inter)
    return inter


def _latencies(profile: ClusterProfile, protocol: str) -> tuple[float, float, float, float]:
    """(ring base, tree base, intra hop, inter hop) in µs for a protocol."""
    if protocol == "ll":
        return (
            profile.ring_base_latency_ll_us,
            profile.tree_base_latency_ll_us,
            profile.intra_hop_latency_ll_us,
            profile.inter_hop_latency_ll_us,
        )
    return (
        profile.ring_base_latency_simple_us,
        profile.tree_base_latency_simple_us,
        profile.intra_hop_latency_simple_us,
        profile.inter_hop_latency_simple_us,
    )


def _protocols(profile: ClusterProfile, topo: GroupTopology, busbw: float) -> list[tuple[str, float]]:
    """(protocol, its bus bandwidth) pairs that may run on the group."""
    out = [("simple", busbw)]
    if profile.ll_bandwidth_fraction > 0 and profile.collective_library != "gloo":
        ll_bw = busbw * profile.ll_bandwidth_fraction
        # NCCL caps LL by GPU generation inside a node and by host CPU across nodes (tuning.cc llMaxBws)
        cap = profile.ll_max_bw_inter_gbps if topo.nodes > 1 else profile.ll_max_bw_intra_gbps
        out.append(("ll", min(ll_bw, cap) if cap > 0 else ll_bw))
    return out


#: bytes a gloo rank writes into its TCP socket before the peer must read them: a chunk up to this size does
#: not delay the peer's start (read off the emulated-link sweep it is checked against: 1 MiB all-gathers on
#: time, 4 MiB ones 1 MiB chunk late less about this much; about Linux's default socket send buffer)
GLOO_UNBLOCKED_BYTES = 256 * 1024


def _band(bands: tuple[tuple[int, float, float], ...], nbytes: float) -> tuple[int, float, float] | None:
    """The first of the profile's ``small_collective_bands`` that holds ``nbytes``, or None above the last."""
    for band in bands:
        if nbytes <= band[0]:
            return band
    return None


def _ms(latency_us: float, bytes_on_wire: float, bw_gbps: float) -> float:
    # GB/s = 1e9 B/s -> bytes / (bw * 1e9) s = bytes / (bw * 1e6) ms
    return latency_us / 1e3 + bytes_on_wire / (bw_gbps * 1e6)


def estimate_collective(
    op: Union[CollectiveOp, str],
    nbytes: int,
    group_size: int,
    profile: ClusterProfile,
    group_ranks: Sequence[int] | None = None,
) -> CollectiveEstimate:
    """Price one collective on ``profile``; the fastest algorithm/protocol wins (see module docstring)."""
    op = normalize_op(op)
    ranks = _check_group(group_size, group_ranks)
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r} is not valid: expected a non-negative number of bytes")
    kind = KINDS[op]
    n = group_size
    if n == 1 or (nbytes == 0 and not kind.priced_without_payload):
        return CollectiveEstimate(0.0, "none", "none", 0.0, 0.0)
    topo = _topology(profile, n, ranks)
    busbw = bus_bandwidth_gbps(profile, topo)
    gloo = profile.collective_library == "gloo"
    if gloo and kind.gloo_priced_as is not None:
        kind = KINDS[kind.gloo_priced_as]
    floor_ms = profile.collective_floor_us / 1e3
    if profile.small_collective_bands and kind.op.value in BAND_OPS:
        band = _band(profile.small_collective_bands, nbytes)
        if band is not None:  # a measured price, transfer included (module docstring)
            steps = kind.ring_steps(n - 1)
            lat = band[1] + (steps - 1) * band[2] + dict(profile.small_collective_extra_us).get(op.value, 0.0)
            return CollectiveEstimate(max(lat / 1e3, floor_ms), "ring", "band", lat, busbw)
    inter_floor = profile.inter_node_latency_floor_us if topo.nodes > 1 else 0.0

    def lat_floor(lat_us: float) -> float:
        return max(lat_us, inter_floor)

    candidates: list[CollectiveEstimate] = []
    for proto, bw in _protocols(profile, topo, busbw):
        bw_scale = bw / busbw
        ring_base, tree_base, h_intra, h_inter = _latencies(profile, proto)
        if "ring" in kind.algorithms:
            steps = kind.ring_steps(n - 1)
            inter_steps = kind.ring_steps(topo.nodes - 1)
            ring_intra = h_intra
            if topo.nodes > 1:
                # NCCL: a ring spanning nodes posts network work at every step (Simple: 3 posts)
                ring_intra = max(h_intra, profile.net_overhead_us * (3 if proto == "simple" else 1))
            lat = lat_floor(ring_base + (steps - inter_steps) * ring_intra + inter_steps * h_inter)
            wire = kind.ring_wire_bytes(nbytes, n)
            if gloo and kind.gathers:  # one half-shard chunk starts late (module docstring)
                wire += max(0.0, nbytes / n / 2 - GLOO_UNBLOCKED_BYTES)
            candidates.append(CollectiveEstimate(_ms(lat, wire, bw), "ring", proto, lat, bw))
        if "tree" in kind.algorithms and not gloo:
            depth_intra = topo.max_ranks_per_node - 1
            depth_inter = math.ceil(math.log2(topo.nodes)) if topo.nodes > 1 else 0
            lat = lat_floor(tree_base + 2 * (depth_intra * h_intra + depth_inter * h_inter))
            tbw = bw * profile.tree_bandwidth_fraction
            candidates.append(CollectiveEstimate(_ms(lat, 2 * nbytes, tbw), "tree", proto, lat, tbw))
        if "pairwise" in kind.algorithms:
            k = topo.max_ranks_per_node
            lat = lat_floor(ring_base + (h_intra if k > 1 else 0.0) + (h_inter if topo.nodes > 1 else 0.0))
            t_intra = nbytes * (k - 1) / n / (profile.intra_node_bw_gbps * bw_scale * 1e6)
            t_inter = 0.0
            if topo.nodes > 1:
                per_rank_nic = _inter_bw(profile, topo) / k
                t_inter = nbytes * (n - k) / n / (per_rank_nic * bw_scale * 1e6)
            candidates.append(CollectiveEstimate(lat / 1e3 + max(t_intra, t_inter), "pairwise", proto, lat, bw))
    best = min(candidates, key=lambda c: (c.ms, c.algorithm, c.protocol))
    if best.ms < floor_ms:
        # back-to-back calls cannot complete faster than they are issued; the transfer hides under the floor
        best = replace(best, ms=floor_ms)
    return best


def collective_ms(*args: Any, **kwargs: Any) -> float:
    """Milliseconds for one collective: ``estimate_collective(...).ms``, with the same arguments."""
    return estimate_collective(*args, **kwargs).ms
