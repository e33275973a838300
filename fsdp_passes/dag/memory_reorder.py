"""The order Inductor's peak-memory reordering gives a graph's kernels, predicted on the neutral DAG.

After fusion, and before any scheduler pass sees the nodes, Inductor reorders them for peak memory
(``reorder_for_peak_memory``, on by default): it estimates the peak of the order it has and of three
heuristic topological orders, and keeps the lowest.  ``predict_memory_reorder(dag)`` makes the same choice
on a DAG of kernels (``predict_kernels``' result, whose index order stands for Inductor's order after
fusion), so that the simulator's peak of the returned order is the peak of what the scheduler pass receives.

The three heuristics, as this module implements them:

- least peak memory first: a greedy list schedule that runs, among the ready nodes, one that fits under the
  peak reached so far and leaves the least memory allocated (else the one that allocates least);
- breadth first: the ready node whose predecessors ran earliest (FIFO: a buffer is read soon after it is
  written);
- depth first: nodes visited from the smallest (its output plus the buffers it reads), each after its
  predecessors, themselves visited smallest first.

Inductor judges the orders by its own estimate, which is not the simulator's, and the choice follows it:

- graph inputs it may free (a backward's saved activations; not parameters ``primals_*``, ``arg*``, random
  states or tangents) are live from the start until their last reader;
- a buffer lives from its producer to its last reader (each of a node's ``output_buffers`` to its own; one
  no memory holds, as Inductor counts it too); a collective's waits read the collective's inputs, so those
  live until the wait; a graph output lives to the end;
- every collective follows the previous collective (any process group) or, when that collective's wait
  comes before it in the graph's order, that wait: Inductor orders collectives globally before fusing.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from .graph import Dag, NodeKind, buffer_readers, buffer_roots

__all__ = ["NON_FREEABLE_INPUT_PREFIXES", "inductor_peak_estimate", "predict_memory_reorder"]

#: graph inputs Inductor never frees inside the graph (parameters, tangents, random states): by name
NON_FREEABLE_INPUT_PREFIXES = ("primals_", "arg", "fwd_rng_state", "bwd_rng_state", "tangents")


class _MemoryGraph:
    """A DAG as Inductor's peak-memory reordering sees it.

    Buffers are numbered: ``0..n-1`` the buffer node ``i`` allocates (0 bytes for a node that aliases
    another), then the freeable graph inputs, then the graph-output part of nodes whose outputs are only
    partly graph outputs (``DagNode.graph_output_bytes``).  ``producer[b]``: the node allocating ``b`` (-1: a
    graph input, live from the start); ``users[b]``: the nodes after which ``b`` may be freed; ``pinned[b]``:
    never freed.  ``deps`` / ``preds`` / ``succs``: the ordering constraints.
    """

    def __init__(self, dag: Dag) -> None:
        nodes = dag.nodes
        n = len(nodes)
        root = buffer_roots(dag)
        self.n = n
        # what Inductor counts a node allocating: a buffer laid out inside another one too
        self.size = [int(node.out_bytes) + int(node.non_owning_bytes)
                     if node.alias_of is None and node.op != "placeholder" else 0 for node in nodes]
        # a fallback kernel whose results the FX prediction keeps as its own buffers: Inductor unpacks each in a
        # node that allocates and reads nothing it counts (a MultiOutput), which its depth-first order reaches
        # first, and through it the kernel: the kernel is visited as a node of no weight
        self.unpacked = [bool(node.output_buffers) and not node.op.startswith("kernel[")
                         and isinstance(getattr(node.origin, "meta", {}).get("val"), (tuple, list)) for node in nodes]
        buffer_size = list(self.size)
        producer = list(range(n))
        pinned = [False] * n
        # graph inputs: the size the last reader (index order) reports, as Inductor keeps the last one seen
        input_ids: dict[str, int] = {}
        for node in nodes:
            for name, nbytes in node.input_reads.items():
                if name.startswith(NON_FREEABLE_INPUT_PREFIXES):
                    continue
                if name not in input_ids:
                    input_ids[name] = len(buffer_size)
                    buffer_size.append(0)
                    producer.append(-1)
                    pinned.append(False)
                buffer_size[input_ids[name]] = int(nbytes)
        # a node writing several buffers: one buffer each (the node's own id then holds nothing), read by
        # the successors that name it; a reader through a view or wait of the node reads all of them
        own: list[list[int]] = [[v] for v in range(n)]
        read_by: dict[int, dict[int, list[int]]] = {}
        for i, bufs in enumerate(buffer_readers(dag)):
            if not bufs or nodes[i].alias_of is not None:
                continue
            buffer_size[i] = 0
            own[i] = []
            per_reader: dict[int, list[int]] = {}
            read_by[i] = per_reader
            for buf, readers in bufs:
                b = len(buffer_size)
                own[i].append(b)
                buffer_size.append(int(buf.nbytes))
                producer.append(i)
                pinned.append(bool(buf.graph_output))
                for v in readers:
                    per_reader.setdefault(v, []).append(b)
        # graph outputs live to the end: the whole buffer, or the graph-output part of a node's outputs
        for i, node in enumerate(nodes):
            if not node.is_output or i in read_by:
                continue
            kept = int(node.graph_output_bytes)
            if node.alias_of is not None or not 0 < kept < buffer_size[i]:
                for b in own[root[i]]:
                    pinned[b] = True
                continue
            buffer_size[i] -= kept
            own[i].append(len(buffer_size))
            buffer_size.append(kept)
            producer.append(i)
            pinned.append(True)
        self.buffer_size, self.producer, self.pinned, self.own = buffer_size, producer, pinned, own

        # which buffers each node reads: its predecessors' buffers (an alias: the buffer it lives in) and inputs
        reads: list[set[int]] = [set() for _ in range(n)]
        for v in range(n):
            for p in dag.preds[v]:
                r = root[p]
                if p == r and r in read_by:
                    reads[v].update(read_by[r].get(v, ()))
                else:
                    reads[v].update(own[r])
            for name in nodes[v].input_reads:
                if name in input_ids:
                    reads[v].add(input_ids[name])
            if nodes[v].alias_of is not None:
                reads[v].update(own[root[v]])
        # a wait reads its collective's inputs too (they stay alive until it ran)
        collective_of = _waited_collectives(dag)
        for w, c in enumerate(collective_of):
            if c >= 0:
                reads[w] |= reads[c] - set(own[c])
        self.users: list[list[int]] = [[] for _ in buffer_size]
        self.reads: list[list[int]] = []
        for v in range(n):
            reads[v].difference_update(own[v])
            self.reads.append(sorted(reads[v]))
            for b in self.reads[v]:
                self.users[b].append(v)

        # ordering: data and mutation edges, a reader of an alias also after the buffer's owner, a wait after
        # its collective's inputs, and the global collective chain
        deps: list[set[int]] = [set(dag.preds[v]) for v in range(n)]  # what a node names as its inputs
        for w, c in enumerate(collective_of):
            if c >= 0:
                deps[w] |= deps[c]
        waits_of: dict[int, list[int]] = {}
        for w, c in enumerate(collective_of):
            if c >= 0:
                waits_of.setdefault(c, []).append(w)
        collectives = [i for i, node in enumerate(nodes) if node.kind is NodeKind.COLLECTIVE]
        for prev, nxt in zip(collectives, collectives[1:]):
            earlier_waits = [w for w in waits_of.get(prev, []) if w < nxt]
            deps[nxt] |= set(earlier_waits) if earlier_waits else {prev}
        # the predecessors Inductor counts: a node read through an alias (a wait) and the alias's owner
        self.deps: list[list[int]] = []
        self.preds: list[list[int]] = []
        self.succs: list[list[int]] = [[] for _ in range(n)]
        for v in range(n):
            deps[v].discard(v)
            preds = deps[v] | {root[p] for p in deps[v]}
            preds.discard(v)
            self.deps.append(sorted(deps[v]))
            self.preds.append(sorted(preds))
            for p in self.preds[v]:
                self.succs[p].append(v)

    # -- Inductor's estimate -----------------------------------------------------------------------------------
    def peak(self, order: Sequence[int]) -> int:
        """Largest live total of an order: inputs from the start, buffers from their producer, each until its
        last user (a buffer nobody reads: its producer's step); graph outputs to the end."""
        n = self.n
        pos = [0] * n
        for p, v in enumerate(order):
            pos[v] = p
        delta = [0] * (n + 1)
        for b, size in enumerate(self.buffer_size):
            if not size:
                continue
            start = pos[self.producer[b]] if self.producer[b] >= 0 else 0
            delta[start] += size
            if self.pinned[b]:
                continue
            end = max((pos[u] for u in self.users[b]), default=start)
            delta[end + 1] -= size
        live = peak = 0
        for d in delta:
            live += d
            peak = max(peak, live)
        return peak

    # -- the three heuristics ---------------------------------------------------------------------------------
    def least_peak_first(self) -> list[int]:
        n = self.n
        size, buffer_size, users = self.size, self.buffer_size, self.users
        indegree = [len(p) for p in self.preds]
        unread = [len(users[b]) + (1 if self.pinned[b] else 0) for b in range(len(buffer_size))]
        # bytes running a node would free: buffers it reads last, and its own output if nobody reads it
        frees = [0] * n
        for v in range(n):
            for b in self.reads[v]:
                if unread[b] == 1:
                    frees[v] += buffer_size[b]
            for b in self.own[v]:
                if unread[b] == 0:
                    frees[v] += buffer_size[b]
        live = sum(size for b, size in enumerate(buffer_size) if self.producer[b] < 0)
        outputs = sum(size for b, size in enumerate(buffer_size) if self.pinned[b])
        peak = max(live, outputs)
        ready = [v for v in range(n) if indegree[v] == 0]
        order: list[int] = []
        while ready:
            gap = peak - live
            pick = min(ready, key=lambda v: (size[v] if size[v] > gap else 0, size[v] - frees[v], v))
            ready.remove(pick)
            order.append(pick)
            live += size[pick]
            peak = max(peak, live)
            live -= frees[pick]
            for s in self.succs[pick]:
                indegree[s] -= 1
                if indegree[s] == 0:
                    ready.append(s)
            for b in self.reads[pick]:
                unread[b] -= 1
                if unread[b] == 1:  # its one remaining reader will free it
                    for u in users[b]:
                        frees[u] += buffer_size[b]
        return order

    def breadth_first(self) -> list[int]:
        n = self.n
        indegree = [len(p) for p in self.preds]
        ran_at = [-1] * n
        ready = [([], v) for v in range(n) if indegree[v] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            _, v = heapq.heappop(ready)
            ran_at[v] = len(order)
            order.append(v)
            for s in self.succs[v]:
                indegree[s] -= 1
                if indegree[s] == 0:
                    heapq.heappush(ready, (sorted({ran_at[p] for p in self.preds[s]}), s))
        return order

    def depth_first(self) -> list[int]:
        n = self.n
        weight = [0 if self.unpacked[v] else self.size[v] + sum(self.buffer_size[b] for b in self.reads[v])
                  for v in range(n)]
        by_weight = sorted(range(n), key=lambda v: (weight[v], v))
        sorted_preds = [sorted(self.deps[v], key=lambda p: (weight[p], p)) for v in range(n)]
        seen = [False] * n
        order: list[int] = []
        for start in by_weight:
            if seen[start]:
                continue
            seen[start] = True
            stack = [(start, 0)]  # (node, next predecessor to visit): a recursion without Python's depth limit
            while stack:
                v, k = stack[-1]
                if k < len(sorted_preds[v]):
                    stack[-1] = (v, k + 1)
                    p = sorted_preds[v][k]
                    if not seen[p]:
                        seen[p] = True
                        stack.append((p, 0))
                else:
                    stack.pop()
                    order.append(v)
        return order


def _waited_collectives(dag: Dag) -> list[int]:
    out = [-1] * len(dag)
    for i, node in enumerate(dag.nodes):
        if node.kind is NodeKind.WAIT and node.collective_of is not None:
            out[i] = node.collective_of
    return out


def inductor_peak_estimate(dag: Dag, order: Sequence[int]) -> int:
    """Inductor's own peak-memory estimate of running ``dag``'s nodes in ``order`` (see the module docstring):
    the number its reordering compares, not the simulator's peak."""
    if sorted(order) != list(range(len(dag))):
        raise ValueError(f"order is not a permutation of the {len(dag)} nodes")
    return _MemoryGraph(dag).peak(order)


def predict_memory_reorder(dag: Dag) -> list[int]:
    """The order Inductor's ``reorder_for_peak_memory`` is predicted to give ``dag``'s nodes, taking their
    index order as the order it starts from: of that order and the three heuristic orders, the first with the
    lowest ``inductor_peak_estimate``."""
    graph = _MemoryGraph(dag)
    if not graph.n:
        return []
    start = list(range(graph.n))  # the chain only points backwards in the index order: a valid order
    best, best_peak = start, graph.peak(start)
    for order in (graph.least_peak_first(), graph.breadth_first(), graph.depth_first()):
        if len(order) != graph.n:
            raise ValueError("predict_memory_reorder: the ordering constraints form a cycle")
        peak = graph.peak(order)
        if peak < best_peak:
            best, best_peak = order, peak
    return best
