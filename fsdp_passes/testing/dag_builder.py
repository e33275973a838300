"""Hand-built DAGs for unit tests of planners, the simulator and custom passes."""

from __future__ import annotations

from typing import Sequence

from ..dag.graph import CollectiveOp, Dag, DagNode, NodeKind


class DagBuilder:
    """Nodes get ids in creation order (a valid topological order); edges come from each node's ``inputs``;
    ``durations`` collects one estimate (ms) per node for ``simulate`` / ``plan_order``.

        b = DagBuilder()
        ag = b.coll("ag0", 2.0, out=100)            # an FSDP all-gather on group "0", 2 ms
        w = b.wait("ag0_wait", ag)
        b.compute("mm0", 1.5, w, out=10, output=True)
        timeline = simulate(b.dag(), list(range(len(b.nodes))), b.durations)
    """

    default_group = "0"

    def __init__(self) -> None:
        self.nodes: list[DagNode] = []
        self.edges: list[tuple[int, int]] = []
        self.durations: list[float] = []

    def _add(self, node: DagNode, ms: float, inputs: Sequence[int]) -> int:
        i = len(self.nodes)
        self.nodes.append(node)
        self.durations.append(float(ms))
        self.edges.extend((p, i) for p in inputs)
        return i

    def input(self, name: str) -> int:
        """A node standing for a graph input: allocates nothing, takes no time."""
        return self._add(DagNode(name, NodeKind.COMPUTE, op="placeholder"), 0.0, [])

    def compute(self, name: str, ms: float, *inputs: int, out: int = 0, output: bool = False,
                view_of: int | None = None) -> int:
        """A compute node writing ``out`` bytes (none if it is a view of node ``view_of``)."""
        dag_node = DagNode(name, NodeKind.COMPUTE, op="mm", out_bytes=0 if view_of is not None else out, alias_of=view_of,
                           is_output=output)
        return self._add(dag_node, ms, inputs)

    def coll(self, name: str, ms: float, *inputs: int, op: CollectiveOp = CollectiveOp.ALL_GATHER,
             group: str | None = None, out: int = 0, fsdp: bool = True) -> int:
        """A collective on ``group`` (default ``default_group``) moving and allocating ``out`` bytes."""
        dag_node = DagNode(name, NodeKind.COLLECTIVE, collective=op, group_name=group or self.default_group,
                           comm_bytes=out, out_bytes=out, fsdp=fsdp)
        return self._add(dag_node, ms, inputs)

    def wait(self, name: str, coll: int, ms: float = 0.0, output: bool = False) -> int:
        """The wait of collective ``coll`` (aliases its output)."""
        dag_node = DagNode(name, NodeKind.WAIT, alias_of=coll, collective_of=coll, is_output=output)
        return self._add(dag_node, ms, [coll])

    def dag(self) -> Dag:
        return Dag(self.nodes, self.edges)

    def order(self, *names: str) -> list[int]:
        """Node ids of ``names``, in that order (to write an order by name)."""
        index = {n.name: i for i, n in enumerate(self.nodes)}
        return [index[n] for n in names]
