"""One description per collective kind: what it is, how it buckets, its bytes, its cost, how it waits.

Every module that treats all-gathers, reduce-scatters, all-reduces and all-to-alls differently reads
``KINDS`` instead of naming kinds: the DAG builders (which functional ops issue a kind, where its group
sits among their arguments, its payload), bucketing (which kinds merge, the op the rewrite emits, what a
merge holds), the memory budget, the cost model (ring passes, algorithms, gloo's pricing), calibration
(the eager call it times, the names profilers give its kernels) and what-if (which side is one rank's shard).

Every kind waits the same way: its functional op returns a tensor that one ``wait_tensor`` completes (the
wait aliases the collective's output; its inputs stay alive until then).  Sizes: ``comm_bytes`` is the payload
in NCCL's convention, the full size: an all-gather's gathered output, every other kind's input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .graph import CollectiveOp

__all__ = ["CollectiveKind", "KINDS", "kind_of"]

#: how a kind's output relates to its input (per rank)
GATHERED = "gathered"  # group_size × the input: an all-gather
SCATTERED = "scattered"  # the input / group_size: a reduce-scatter
SAME = "same"  # as large as the input


@dataclass(frozen=True)
class CollectiveKind:
    """What the package knows about one kind of collective.

    ``ops``: the ``torch.ops._c10d_functional`` ops that issue it (single-tensor, out and coalesced
    variants), as post-grad graphs and Inductor's collective kernels name them.
    ``args``: its non-tensor arguments in the schema order of its first op, where they tell the process
    group (empty: the group name is the last argument, nothing else is read).
    ``output``: ``GATHERED``, ``SCATTERED`` or ``SAME`` (see above).
    ``reduces``: it combines the ranks' values with a reduce op.
    ``bucketable``: the FX rewrite merges several of one group into one; ``bucket_op`` is the op it emits,
    the only op a bucket member may be.
    ``movable``: the scheduler pass may move it relative to compute (a kind that is not, a broadcast or
    barrier, is a fence nothing crosses).
    ``algorithms``: what the cost model prices ("ring", "tree", "pairwise"), the fastest winning;
    ``ring_passes``: times a ring moves ``(n-1)/n`` of the payload (``None``: a pipelined ring broadcast of
    the whole payload, one pass of steps); ``priced_without_payload``: a call with no bytes still costs its
    latency (a barrier); ``gloo_priced_as``: the kind whose ring gloo runs instead (its reduce-scatter
    all-reduces the whole input).
    ``eager``: ``torch.distributed`` functions calibration times, the first one present is used (empty: not
    calibrated); ``nccl_names`` / ``gloo_name``: how a profiler's kernel or gloo event names it.
    """

    op: CollectiveOp
    ops: tuple[str, ...]
    args: tuple[str, ...] = ()
    output: str = SAME
    reduces: bool = False
    bucketable: bool = False
    bucket_op: str | None = None
    movable: bool = True
    algorithms: tuple[str, ...] = ("ring",)
    ring_passes: int | None = 1
    priced_without_payload: bool = False
    gloo_priced_as: CollectiveOp | None = None
    eager: tuple[str, ...] = ()
    nccl_names: tuple[str, ...] = ()
    gloo_name: str | None = None

    @property
    def gathers(self) -> bool:
        return self.output == GATHERED

    @property
    def scatters(self) -> bool:
        return self.output == SCATTERED

    def comm_bytes(self, in_bytes: int, out_bytes: int) -> int:
        """The payload (``DagNode.comm_bytes``) of a call with these input and output sizes."""
        return out_bytes if self.gathers else in_bytes

    def output_numel(self, in_numel: int, group_size: int) -> int:
        """Elements one rank's output has for ``in_numel`` input elements."""
        if self.gathers:
            return in_numel * group_size
        if self.scatters:
            return in_numel // group_size
        return in_numel

    def input_numel(self, full_numel: int, group_size: int) -> int:
        """Elements one rank's input has when the payload is ``full_numel`` elements."""
        return full_numel // group_size if self.gathers else full_numel

    @property
    def shard_field(self) -> str | None:
        """The ``DagNode`` size field that holds one rank's shard (an all-gather's ``in_bytes``, a
        reduce-scatter's ``out_bytes``); None where input and output are both full size."""
        return "in_bytes" if self.gathers else "out_bytes" if self.scatters else None

    @property
    def full_field(self) -> str | None:
        """The ``DagNode`` size field other than ``shard_field`` (the full size), None with it."""
        return "out_bytes" if self.gathers else "in_bytes" if self.scatters else None

    def ring_wire_bytes(self, nbytes: float, group_size: int) -> float:
        """Bytes one rank sends on a ring over ``group_size`` ranks for a payload of ``nbytes``."""
        if self.ring_passes is None:
            return nbytes
        return self.ring_passes * nbytes * ((group_size - 1) / group_size)

    def ring_steps(self, hops: int) -> int:
        """Ring steps over ``hops`` hops (``group_size - 1`` in all, ``nodes - 1`` across the network)."""
        return (self.ring_passes or 1) * hops


_C10D = "_c10d_functional."

KINDS: Mapping[CollectiveOp, CollectiveKind] = {k.op: k for k in (
    CollectiveKind(
        CollectiveOp.ALL_GATHER,
        ops=("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"),
        args=("group_size", "group_name"), output=GATHERED,
        bucketable=True, bucket_op=_C10D + "all_gather_into_tensor.default",
        eager=("all_gather_single", "all_gather_into_tensor"), nccl_names=("allgather",), gloo_name="gloo:all_gather"),
    CollectiveKind(
        CollectiveOp.REDUCE_SCATTER,
        ops=("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"),
        args=("reduce_op", "group_size", "group_name"), output=SCATTERED, reduces=True,
        bucketable=True, bucket_op=_C10D + "reduce_scatter_tensor.default", gloo_priced_as=CollectiveOp.ALL_REDUCE,
        eager=("reduce_scatter_single", "reduce_scatter_tensor"), nccl_names=("reducescatter",),
        gloo_name="gloo:reduce_scatter"),
    CollectiveKind(
        CollectiveOp.ALL_REDUCE,
        ops=("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"),
        args=("reduce_op", "group_name"), reduces=True,
        bucketable=True, bucket_op=_C10D + "all_reduce.default",
        algorithms=("ring", "tree"), ring_passes=2,
        eager=("all_reduce",), nccl_names=("allreduce",), gloo_name="gloo:all_reduce"),
    CollectiveKind(
        CollectiveOp.ALL_TO_ALL,
        ops=("all_to_all_single",),
        algorithms=("pairwise",), nccl_names=("alltoall", "sendrecv"), gloo_name="gloo:all_to_all"),
    CollectiveKind(
        CollectiveOp.OTHER,
        ops=("broadcast", "broadcast_", "isend", "irecv", "send", "recv", "barrier"),
        movable=False, ring_passes=None, priced_without_payload=True),
)}


def kind_of(op: CollectiveOp | str) -> CollectiveKind:
    """The record of ``op`` (a ``CollectiveOp`` or its value)."""
    return KINDS[CollectiveOp(op)]
