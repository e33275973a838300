"""Property tests of the simulator on random DAGs and random valid orders."""

from __future__ import annotations

import itertools
import random

import networkx as nx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_passes.dag import CollectiveOp, Dag, DagNode, NodeKind
from fsdp_passes.simulate import lower_bound, memory_curve, peak_memory, simulate

C, K, W = NodeKind.COMPUTE, NodeKind.COLLECTIVE, NodeKind.WAIT
EPS = 1e-9


@st.composite
def random_dags(draw, max_steps: int = 30) -> tuple[Dag, list[float]]:
    """Compute nodes over earlier values, collectives in a few groups, waits for most of them, views."""
    groups = draw(st.lists(st.sampled_from(["dp", "tp", "pp"]), min_size=1, max_size=3, unique=True))
    step_kinds = st.sampled_from(["compute", "compute", "coll", "wait"])
    steps = draw(st.lists(step_kinds, min_size=min(6, max_steps), max_size=max_steps))
    nodes: list[DagNode] = []
    edges: list[tuple[int, int]] = []
    values: list[int] = []  # nodes whose output compute and collectives may read
    pending: list[int] = []  # collectives without a wait yet

    def pick_inputs(most: int) -> list[int]:
        if not values:
            return []
        return draw(st.lists(st.sampled_from(values), max_size=most, unique=True))

    for step in steps:
        i = len(nodes)
        name = f"n{i}"
        if step == "compute":
            inputs = pick_inputs(3)
            view_of = inputs[0] if inputs and draw(st.integers(0, 3)) == 0 else None
            out = 0 if view_of is not None else draw(st.integers(0, 100))
            nodes.append(DagNode(name, C, out_bytes=out, alias_of=view_of, is_output=draw(st.integers(0, 5)) == 0))
            values.append(i)
        elif step == "coll":
            inputs = pick_inputs(2)
            op = draw(st.sampled_from([CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER]))
            nodes.append(DagNode(name, K, collective=op, group_name=draw(st.sampled_from(groups)),
                                 out_bytes=draw(st.integers(0, 100))))
            pending.append(i)
        else:
            if not pending:
                continue
            c = draw(st.sampled_from(pending))
            pending.remove(c)
            inputs = [c]
            nodes.append(DagNode(name, W, alias_of=c, collective_of=c, is_output=draw(st.integers(0, 7)) == 0))
            values.append(i)
        edges.extend((p, i) for p in inputs)
    if draw(st.booleans()):  # sometimes every collective is waited on at the end
        for c in pending:
            i = len(nodes)
            nodes.append(DagNode(f"n{i}", W, alias_of=c, collective_of=c))
            edges.append((c, i))
    durations = draw(st.lists(st.floats(0, 10, allow_nan=False, allow_infinity=False),
                              min_size=len(nodes), max_size=len(nodes)))
    return Dag(nodes, edges), durations


def random_valid_order(dag: Dag, rnd: random.Random) -> list[int]:
    """A uniformly chosen ready node at each step, with each group's collectives kept in sequence."""
    n = len(dag)
    succs = [list(s) for s in dag.succs]
    indeg = [len(p) for p in dag.preds]
    for seq in dag.group_sequences().values():
        for a, b in zip(seq, seq[1:]):
            succs[a].append(b)
            indeg[b] += 1
    ready = [i for i in range(n) if indeg[i] == 0]
    order = []
    while ready:
        k = rnd.randrange(len(ready))
        ready[k], ready[-1] = ready[-1], ready[k]
        u = ready.pop()
        order.append(u)
        for v in succs[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    assert len(order) == n
    return order


def reference_memory(dag: Dag, order: list[int]) -> list[int]:
    """Quadratic restatement of the memory rules: a buffer is live at p if allocated by then and needed
    at p or later."""
    n = len(dag)
    pos = {u: p for p, u in enumerate(order)}

    def root(i: int) -> int:
        while dag[i].alias_of is not None:
            i = dag[i].alias_of
        return i

    needed_until: dict[int, int] = {}
    for r in range(n):
        if dag[r].alias_of is not None:
            continue
        members = [i for i in range(n) if root(i) == r]
        last = max(pos[i] for i in members)
        for m in members:
            for s in dag.succs[m]:
                last = max(last, pos[s])
            if dag[m].is_output:
                last = n - 1
        for c in range(n):
            if dag[c].kind is K and any(root(p) == r for p in dag.preds[c]):
                waits = [w for w in range(n) if dag[w].kind is W and dag[w].collective_of == c]
                last = max(last, max((pos[w] for w in waits), default=n - 1))
        needed_until[r] = last
    return [
        sum(dag[r].out_bytes for r, last in needed_until.items() if pos[r] <= p <= last)
        for p in range(n)
    ]


def spec_bound(dag: Dag, durations: list[float]) -> float:
    """max(total compute, head + comm + tail) per group with whole-group windows, via networkx."""
    g = dag.to_networkx()
    is_coll = [node.kind is K for node in dag]
    total = sum(d for d, c in zip(durations, is_coll) if not c)
    best = total
    for seq in dag.group_sequences().values():
        head = sum(durations[a] for a in nx.ancestors(g, seq[0]) if not is_coll[a])
        tail_nodes = set()
        for w in dag.waits_of(seq[-1]):
            tail_nodes |= {w} | nx.descendants(g, w)
        tail = sum(durations[a] for a in tail_nodes if not is_coll[a])
        best = max(best, head + sum(durations[c] for c in seq) + tail)
    return best


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags(), st.randoms(use_true_random=False))
def test_timeline_invariants(dag_durs, rnd):
    dag, durs = dag_durs
    order = random_valid_order(dag, rnd)
    tl = simulate(dag, order, durs)
    total_compute = sum(d for d, node in zip(durs, dag) if node.kind is not K)
    lb = lower_bound(dag, durs)

    assert tl.lower_bound == lb
    assert lb >= total_compute - EPS
    assert lb >= spec_bound(dag, durs) - EPS
    assert tl.makespan >= lb - EPS
    assert tl.makespan >= total_compute - EPS
    assert abs(tl.compute_busy - total_compute) <= EPS * max(1.0, total_compute)
    assert tl.compute_idle >= -EPS
    assert all(e >= 0 for e in tl.exposed.values())
    assert set(tl.exposed) == set(dag.collectives())
    assert abs(tl.exposed_total - sum(tl.exposed.values())) <= EPS * max(1.0, tl.exposed_total)

    # streams: compute nodes back to back in order, group collectives FIFO, nothing before its issue
    t = 0.0
    for i in order:
        assert tl.issue[i] == t
        if dag[i].kind is not K:
            t = tl.end[i]
        else:
            assert tl.start[i] >= tl.issue[i]
        assert tl.end[i] >= tl.start[i]
        assert tl.end[i] <= tl.makespan + EPS
    for seq in dag.group_sequences().values():
        for a, b in zip(seq, seq[1:]):
            assert tl.start[b] >= tl.end[a]
    for w, node in enumerate(dag):
        if node.kind is W:
            assert tl.end[w] >= tl.end[node.collective_of]

    curve = memory_curve(dag, order)
    assert curve == tl.memory
    assert all(m >= 0 for m in curve)
    assert tl.peak_memory == max(curve, default=0) == peak_memory(dag, order)
    assert curve == reference_memory(dag, order)


def all_valid_orders(dag: Dag):
    """Every topological order that keeps each group's collective sequence (small DAGs only)."""
    n = len(dag)
    succs = [list(s) for s in dag.succs]
    indeg = [len(p) for p in dag.preds]
    for seq in dag.group_sequences().values():
        for a, b in zip(seq, seq[1:]):
            succs[a].append(b)
            indeg[b] += 1
    order: list[int] = []

    def extend():
        if len(order) == n:
            yield list(order)
            return
        for u in range(n):
            if indeg[u] == 0 and u not in order:
                order.append(u)
                for v in succs[u]:
                    indeg[v] -= 1
                yield from extend()
                for v in succs[u]:
                    indeg[v] += 1
                order.pop()

    yield from extend()


@settings(max_examples=40, deadline=None)
@given(random_dags(max_steps=6))
def test_lower_bound_holds_for_every_valid_order_of_small_dags(dag_durs):
    dag, durs = dag_durs
    lb = lower_bound(dag, durs)
    best = float("inf")
    for order in itertools.islice(all_valid_orders(dag), 5000):
        assert not dag.order_violations(order)
        best = min(best, simulate(dag, order, durs).makespan)
    assert best >= lb - EPS
