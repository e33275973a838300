"""The neutral dependency DAG every planner, the simulator and the dumps work on.

Nodes are numbered 0..n-1 in the order of the graph they were built from (a valid topological order).
Edges are data or mutation dependencies only.  The issue order of collectives inside one process group is
not an edge: it is a constraint (``Dag.group_sequences``) that reordering must keep so that every rank issues
the same collectives in the same order.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Iterator, Sequence

from .gc_pause import collector_paused


class NodeKind(str, enum.Enum):
    COMPUTE = "compute"
    COLLECTIVE = "collective"
    WAIT = "wait"


class CollectiveOp(str, enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"
    OTHER = "other"  # broadcast, send/recv, barrier, ...: never moved across, never bucketed


@dataclass(frozen=True)
class OutputBuffer:
    """One of the buffers a node writes when it writes several (a fused kernel's outputs, a fallback kernel's
    results): each lives from the node until its own last reader, not until the last reader of any of them.

    ``readers``: names of the nodes that read it (successors of the node, or readers of the new name a later
    node gives the buffer by writing into it; a node that reads it through a view or wait of the node counts
    as reading every buffer of the node).  ``allocated`` False: a buffer Inductor's
    memory planning counts but no memory holds: one laid out inside another buffer (a concatenation's slice)
    or read only inside the kernel that writes it.
    """

    nbytes: int
    readers: tuple[str, ...] = ()
    graph_output: bool = False
    allocated: bool = True


@dataclass(slots=True)
class DagNode:
    """One node of the DAG.

    ``comm_bytes`` is the payload the collective moves in NCCL's convention: the full (gathered) size for an
    all-gather, the full (pre-scatter) input for a reduce-scatter, the buffer size for an all-reduce.
    ``out_bytes`` is what the node allocates; a node whose output is a view of another node's buffer (a wait
    aliases its collective's output) has ``alias_of`` set and allocates nothing itself.
    """

    name: str
    kind: NodeKind
    op: str = ""
    collective: CollectiveOp | None = None
    group_name: str | None = None
    group_size: int | None = None
    group_ranks: tuple[int, ...] | None = None
    reduce_op: str | None = None  # "sum", "avg", ... for reductions: never bucketed across ops
    comm_bytes: int = 0
    in_bytes: int = 0
    out_bytes: int = 0
    dtype: str | None = None
    flops: float = 0.0
    alias_of: int | None = None
    collective_of: int | None = None  # for a wait: the index of its collective
    is_output: bool = False  # its buffer is a graph output: alive until the end
    fsdp: bool = False  # an all-gather of a parameter shard / reduce-scatter of a gradient
    module_fqn: str | None = None
    param_fqn: str | None = None
    # what a measured kernel time is matched by (``Calibration.kernel_ms``): the name stem of a generated
    # kernel ("fused_relu_sum", as Inductor names it) or "<aten op> <shapes>" for an extern kernel ("aten.mm float32[2,64];float32[64,128];float32[2,128]")
    kernel_key: str | None = None
    # False for a node that runs no kernel although it owns a buffer: Inductor's NopKernel for a concatenation
    # whose inputs were written into it in place, the MultiOutput unpacking of a fallback kernel's results
    launches_kernel: bool = True
    # graph inputs (placeholders: parameter shards, saved activations, tangents) the node reads, name -> bytes:
    # they are not nodes, and Inductor's memory reordering counts the ones it may free
    input_reads: dict[str, int] = field(default_factory=dict)
    # bytes of outputs laid out inside another node's buffer (a concatenation's input written into its slice
    # of the result): they allocate nothing (not in ``out_bytes``), but Inductor's memory planning counts them
    non_owning_bytes: int = 0
    # with ``is_output``: the bytes of its outputs that are graph outputs, when a kernel writes both graph
    # outputs and buffers the graph frees (0: all of ``out_bytes``).  Inductor frees the rest after the
    # last reader; the simulator keeps the whole buffer
    graph_output_bytes: int = 0
    # a node writing several buffers, or one read under another name: each one (its allocated ones sum to
    # ``out_bytes``, the rest to ``non_owning_bytes``).  Empty: one buffer of ``out_bytes`` that every
    # successor reads
    output_buffers: tuple[OutputBuffer, ...] = ()
    # nodes sharing this number are emitted as one generated kernel while they stay next to each other
    # (Inductor's C++ backend writes a run of consecutive compute nodes as one function); a node placed
    # between them splits it into kernels of their own, each compiled.  None: a kernel of its own
    kernel_group: int | None = None
    origin: Any = field(default=None, repr=False, compare=False)  # fx.Node or scheduler node

    def __copy__(self) -> "DagNode":
        # shallow, as ``copy.copy``; through the constructor, about 5x faster than the reduce protocol a
        # slotted class otherwise goes through (the placement copies every node of a graph it renumbers)
        return DagNode(*_FIELD_VALUES(self))


_FIELD_VALUES = operator.attrgetter(*(f.name for f in fields(DagNode)))


class Dag:
    """A plain DAG over ``DagNode``s with integer ids, adjacency lists and reachability queries."""

    @collector_paused()
    def __init__(self, nodes: Sequence[DagNode], edges: Iterable[tuple[int, int]], resident_bytes: int = 0):
        self.nodes: list[DagNode] = list(nodes)
        # bytes of the graph's inputs (parameter shards, saved activations): not nodes; reported in dumps
        self.resident_bytes = int(resident_bytes)
        n = len(self.nodes)
        preds: list[list[int]] = [[] for _ in range(n)]
        for src, dst in edges:
            if src == dst:
                continue
            if not (0 <= src < n and 0 <= dst < n):
                raise ValueError(f"edge ({src}, {dst}) names a node outside 0..{n - 1}")
            preds[dst].append(src)
        for dst, ps in enumerate(preds):
            if len(ps) > 1:  # most nodes have one input: no set, no sort
                preds[dst] = sorted(set(ps))
        self.preds: list[list[int]] = preds
        succs: list[list[int]] = [[] for _ in range(n)]
        for dst, ps in enumerate(preds):
            for src in ps:
                succs[src].append(dst)
        self.succs: list[list[int]] = succs
        self.index: dict[str, int] = {node.name: i for i, node in enumerate(self.nodes)}
        if len(self.index) != n:
            seen: set[str] = set()
            for node in self.nodes:
                if node.name in seen:
                    raise ValueError(f"duplicate node name {node.name!r}")
                seen.add(node.name)
        self._topo_rank, self._ids_in_order = _topological_rank(self.preds, self.succs)
        self._reach_cache: dict[int, int] = {}

    # -- basic access -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[DagNode]:
        return iter(self.nodes)

    def __getitem__(self, i: int) -> DagNode:
        return self.nodes[i]

    def edges(self) -> Iterator[tuple[int, int]]:
        for dst, ps in enumerate(self.preds):
            for src in ps:
                yield src, dst

    def collectives(self) -> list[int]:
        collective = NodeKind.COLLECTIVE  # a local: reading an enum member off its class costs several times more
        return [i for i, n in enumerate(self.nodes) if n.kind is collective]

    def waits_of(self, collective: int) -> list[int]:
        return [s for s in self.succs[collective] if self.nodes[s].kind is NodeKind.WAIT]

    def group_sequences(self) -> dict[str, list[int]]:
        """Per process group, its collectives in the graph's issue order (node index order)."""
        seqs: dict[str, list[int]] = {}
        collective = NodeKind.COLLECTIVE
        for i, node in enumerate(self.nodes):
            if node.kind is collective:
                seqs.setdefault(node.group_name or "?", []).append(i)
        return seqs

    # -- reachability ------------------------------------------------------------------------------------
    def reaches(self, src: int, dst: int) -> bool:
        """True if there is a path src -> ... -> dst (src != dst).

        A DFS from ``src`` that never enters a node ranked at or after ``dst`` in topological order: the
        search stays inside the window between the two nodes instead of walking the whole graph.
        """
        if src == dst:
            return False
        rank = self._topo_rank
        limit = rank[dst]
        if rank[src] >= limit:
            return False
        stack = [src]
        seen = {src}
        succs = self.succs
        while stack:
            u = stack.pop()
            for v in succs[u]:
                if v == dst:
                    return True
                if v not in seen and rank[v] < limit:
                    seen.add(v)
                    stack.append(v)
        return False

    def ancestors_mask(self, i: int) -> int:
        """Ancestors of ``i`` as a bitset (Python int): one DFS over the ancestors, memoised per queried node.

        Only queried nodes are cached (caching every node's set costs O(V^2) bits on long chains).
        """
        cached = self._reach_cache.get(i)
        if cached is not None:
            return cached
        mask = 0
        stack = list(self.preds[i])
        while stack:
            u = stack.pop()
            bit = 1 << u
            if mask & bit:
                continue
            mask |= bit
            stack.extend(p for p in self.preds[u] if not (mask >> p) & 1)
        self._reach_cache[i] = mask
        return mask

    def ids_in_topological_order(self) -> bool:
        """True when every edge goes from a lower id to a higher one (the ids are a topological order, so the
        order ``0..n-1`` is a valid schedule: group sequences are in id order by definition)."""
        return self._ids_in_order

    def topological_order(self) -> list[int]:
        return sorted(range(len(self.nodes)), key=self._topo_rank.__getitem__)

    # -- order checks -------------------------------------------------------------------------------------
    def order_violations(self, order: Sequence[int], limit: int = 10) -> list[str]:
        """Why ``order`` is not a valid schedule of this DAG (empty when it is).

        Checks that it is a permutation, that every edge points forward, and that each process group issues
        its collectives in the original sequence.
        """
        problems: list[str] = []
        n = len(self.nodes)
        if len(order) != n or sorted(order) != list(range(n)):
            missing = set(range(n)) - set(order)
            extra = len(order) - len(set(order))
            problems.append(
                f"not a permutation of the {n} nodes: {len(order)} entries, "
                f"{len(missing)} missing, {extra} duplicated"
            )
            return problems
        pos = [0] * n
        for p, i in enumerate(order):
            pos[i] = p
        for dst, ps in enumerate(self.preds):  # the edges, in ``edges()`` order, without a generator
            at = pos[dst]
            for src in ps:
                if pos[src] > at:
                    problems.append(f"{self.nodes[dst].name} is placed before its input {self.nodes[src].name}")
                    if len(problems) >= limit:
                        return problems
        for group, seq in self.group_sequences().items():
            placed = sorted(seq, key=pos.__getitem__)
            if placed != seq:
                first = next(k for k in range(len(seq)) if placed[k] != seq[k])
                problems.append(
                    f"process group {group!r}: collective {self.nodes[placed[first]].name} is issued before "
                    f"{self.nodes[seq[first]].name}, changing the group's collective order"
                )
                if len(problems) >= limit:
                    return problems
        return problems

    # -- export ---------------------------------------------------------------------------------------------
    def to_networkx(self):  # -> networkx.DiGraph
        import networkx as nx

        g = nx.DiGraph()
        for i, node in enumerate(self.nodes):
            g.add_node(i, **{f.name: getattr(node, f.name) for f in fields(node) if f.name != "origin"})
        g.add_edges_from(self.edges())
        return g

    def to_dot(self, name: str = "dag") -> str:
        colours = {NodeKind.COLLECTIVE: "#f4a261", NodeKind.WAIT: "#e9c46a", NodeKind.COMPUTE: "#ffffff"}
        lines = [f'digraph "{name}" {{', "  node [shape=box, style=filled, fontname=monospace];"]
        for i, node in enumerate(self.nodes):
            label = node.name if node.kind is NodeKind.COMPUTE else f"{node.name}\\n{node.collective.value if node.collective else 'wait'}"
            if node.group_name is not None:
                label += f"\\npg={node.group_name}"
            lines.append(f'  n{i} [label="{label}", fillcolor="{colours[node.kind]}"];')
        for src, dst in self.edges():
            lines.append(f"  n{src} -> n{dst};")
        lines.append("}")
        return "\n".join(lines) + "\n"


def _topological_rank(preds: list[list[int]], succs: list[list[int]]) -> tuple[list[int], bool]:
    """Kahn's algorithm, ties broken by node index so the result is deterministic; raises on a cycle.  Also
    says whether the ids already were a topological order."""
    import heapq

    n = len(preds)
    if all(not ps or ps[-1] < dst for dst, ps in enumerate(preds)):  # each list is sorted
        # the usual case (nodes numbered in graph order): the index order is the tie-broken Kahn order
        return list(range(n)), True
    indeg = [len(p) for p in preds]
    ready = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    rank = [0] * n
    k = 0
    while ready:
        u = heapq.heappop(ready)
        rank[u] = k
        k += 1
        for v in succs[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(ready, v)
    if k != n:
        raise ValueError(f"dependency graph has a cycle through {n - k} nodes")
    return rank, False


def buffer_readers(dag: Dag) -> list[list[tuple[OutputBuffer, list[int]]]]:
    """Per node, each of its ``output_buffers`` with the ids of the nodes that read it (empty for a node
    described as one buffer).  A reader comes after the node in every valid order: a successor, or a reader of
    the new name a later node gave the buffer by writing into it; a name not in the DAG is ignored."""
    out: list[list[tuple[OutputBuffer, list[int]]]] = [[] for _ in dag.nodes]
    index = dag.index
    for i, node in enumerate(dag.nodes):
        for buf in node.output_buffers:
            out[i].append((buf, sorted({index[r] for r in buf.readers if r in index and index[r] != i})))
    return out


def buffer_roots(dag: Dag) -> list[int]:
    """For every node, the node that owns the buffer it produces (itself unless it aliases another)."""
    nodes = dag.nodes
    n = len(nodes)
    alias = [node.alias_of for node in nodes]
    # a node that aliases nothing owns its buffer (most nodes): resolved without a walk
    root = [i if a is None else -1 for i, a in enumerate(alias)]
    for i in range(n):
        if root[i] >= 0:
            continue
        chain: list[int] = []
        j = i
        # walk the alias chain to an owner or to an already resolved node, then write back the whole chain
        while root[j] < 0 and alias[j] is not None:
            chain.append(j)
            j = alias[j]  # type: ignore[assignment]
            if not 0 <= j < n:
                raise ValueError(f"{nodes[chain[-1]].name} aliases node {j}, outside 0..{n - 1}")
            if len(chain) > n:
                raise ValueError(f"alias chain through {nodes[i].name} is a cycle")
        r = root[j] if root[j] >= 0 else j
        root[j] = r
        for c in chain:
            root[c] = r
    return root
