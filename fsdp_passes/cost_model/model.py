"""``CostModel``: milliseconds for every DAG node, analytic unless a calibration table has the answer.

Pure arithmetic on the node's fields: nothing is timed, so the same DAG always gets the same estimate and
every rank plans the same schedule.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping, Sequence, Union

from ..dag.graph import CollectiveOp, Dag, DagNode, NodeKind
from ..simulate.timeline import OverlapCosts
from . import collectives, roofline
from .calibration import Calibration, shapes_key
from .profiles import ClusterProfile, load_profile

__all__ = ["CostModel"]


class CostModel:
    """Collective and compute times on one cluster profile, overridden by a calibration where it has data."""

    def __init__(self, profile: ClusterProfile, calibration: Calibration | None = None):
        if not isinstance(profile, ClusterProfile):
            raise ValueError(f"profile: expected a ClusterProfile, got {type(profile).__name__} (see load_profile)")
        if calibration is not None and not isinstance(calibration, Calibration):
            raise ValueError(f"calibration: expected a Calibration or None, got {type(calibration).__name__}")
        self.profile = profile
        self.calibration = calibration

    @classmethod
    def from_options(
        cls,
        cluster: Union[str, Mapping[str, Any], ClusterProfile] = "h100-nvlink",
        calibration_path: Union[str, "os.PathLike[str]", None] = None,
    ) -> "CostModel":
        """Build from ``Options.cluster`` / ``Options.calibration`` values."""
        calibration = Calibration.load(calibration_path) if calibration_path is not None else None
        return cls(load_profile(cluster), calibration)

    def key(self) -> str:
        """Identifies what this model answers (profile + calibration), for cache keys and dumps."""
        cal = self.calibration.digest() if self.calibration is not None else "none"
        text = json.dumps(self.profile.to_dict(), sort_keys=True)
        return f"{self.profile.name}:{hashlib.sha256(text.encode()).hexdigest()[:12]}:{cal}"

    # -- collectives ------------------------------------------------------------------------------------
    def collective_ms(
        self,
        op: Union[CollectiveOp, str],
        nbytes: int,
        group_size: int,
        group_ranks: Sequence[int] | None = None,
    ) -> float:
        """Time of one collective; ``nbytes`` is the full payload (see ``collectives``)."""
        op = collectives.normalize_op(op)
        if self.calibration is not None and group_size > 1 and nbytes > 0:
            measured = self.calibration.collective_ms(op, nbytes, group_size)
            if measured is not None:
                return measured
        return collectives.collective_ms(op, nbytes, group_size, self.profile, group_ranks)

    def overlap_costs(self) -> OverlapCosts:
        """The profile's overlap terms for ``simulate(..., overlap=...)``: host issue time per collective and
        compute slowdown while a collective runs."""
        return OverlapCosts(
            issue_ms=self.profile.collective_issue_us / 1e3,
            compute_slowdown=self.profile.compute_slowdown_during_comm,
        )

    # -- compute ----------------------------------------------------------------------------------------
    def compute_ms(self, flops: float, bytes_moved: float, dtype: Any = None) -> float:
        """Roofline time of one kernel (launch overhead included)."""
        return roofline.compute_ms(flops, bytes_moved, dtype, self.profile)

    def node_ms(self, node: DagNode) -> float:
        """Time of one DAG node: collectives priced, waits free, compute from calibration or roofline."""
        if node.kind is NodeKind.WAIT or not node.launches_kernel:
            return 0.0
        if node.kind is NodeKind.COLLECTIVE:
            if node.collective is None:
                raise ValueError(f"node {node.name!r}: collective=None, expected a CollectiveOp on a collective node")
            if node.group_size is None:
                raise ValueError(f"node {node.name!r}: group_size=None, expected the process group's size")
            return self.collective_ms(node.collective, node.comm_bytes, node.group_size, node.group_ranks)
        if self.calibration is not None and node.kernel_key:
            measured = self.calibration.kernel_ms(node.kernel_key)
            if measured is not None:
                return measured
        if self.calibration is not None and node.op:
            measured = self.calibration.compute_ms(node.op, _node_shapes(node))
            if measured is not None:
                return measured
        moved = node.in_bytes + node.out_bytes
        if not node.flops and not moved:
            return 0.0  # a view / reshape: no kernel runs
        return self.compute_ms(node.flops, moved, node.dtype)

    def estimate(self, dag: Union[Dag, Sequence[DagNode]]) -> list[float]:
        """One time in ms per node, in the DAG's node order."""
        nodes = dag.nodes if isinstance(dag, Dag) else dag
        if self.calibration is not None:
            return [self.node_ms(n) for n in nodes]
        # without a calibration a node's time is a function of the few fields in its key below, and a layered
        # model repeats the same few combinations: each is priced once
        priced: dict[tuple, float] = {}
        out: list[float] = []
        wait, collective = NodeKind.WAIT, NodeKind.COLLECTIVE  # locals: an enum member off its class costs more
        for n in nodes:
            kind = n.kind
            if kind is wait:
                out.append(0.0)
                continue
            if kind is collective:
                key: tuple = (n.launches_kernel, n.collective, n.comm_bytes, n.group_size, n.group_ranks)
            else:
                key = (n.launches_kernel, n.flops, n.in_bytes + n.out_bytes, n.dtype)
            ms = priced.get(key)
            if ms is None:
                ms = priced[key] = self.node_ms(n)
            out.append(ms)
        return out

    def __repr__(self) -> str:
        return f"CostModel(profile={self.profile.name!r}, calibration={self.calibration!r})"


def _node_shapes(node: DagNode) -> str | None:
    """The shapes string of a compute node's inputs when its origin is an FX node carrying fake values."""
    import torch.fx

    origin = node.origin
    if not isinstance(origin, torch.fx.Node):
        return None
    vals = []
    for a in origin.args:
        for x in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(x, torch.fx.Node) and x.meta.get("val") is not None:
                vals.append(x.meta["val"])
    return shapes_key(vals)
