"""Inductor's fusion rounds, as ``predict_kernels`` models them, never fuse two kernels that a path through
other kernels joins, including a path that an earlier fusion of the same round made.

The graph: ``c = x * 2 -> mm -> a = mm * y * z`` and ``b = y * z * 3 -> mm -> d = mm * x``.  ``a`` and ``b``
share two whole buffers (``y``, ``z``), ``c`` and ``d`` one (``x``), all loops of one size, no path between
either pair: the round fuses ``a`` with ``b`` first (more shared bytes).  That makes a path
``c -> mm -> (a, b) -> mm -> d``, so ``c`` and ``d`` must stay apart (fusing them would give a kernel that runs
before and after itself).  The shape of this graph is what an MoE layer's backward has: per-expert chains
through matmuls whose pointwise ends share the routing buffers.
"""

from __future__ import annotations

import networkx as nx
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fsdp_passes.dag.from_fx import dag_from_fx
from fsdp_passes.dag.fusion import predict_kernels
from fsdp_passes.testing import capture_scheduler_nodes


def _two_chains(x, y, z, w):
    c = x * 2
    a = torch.mm(c, w) * y * z
    b = y * z * 3
    d = torch.mm(b, w) * x
    return a, d


def _args():
    return [torch.randn(16, 16) for _ in range(4)]


def test_a_fusion_earlier_in_the_round_is_seen_by_the_later_ones():
    dag = dag_from_fx(make_fx(_two_chains)(*_args()).graph)
    kernels = predict_kernels(dag)
    # an independent check of the result: its dependencies form a DAG (networkx), and every FX op the
    # graph computes is in exactly one kernel
    g = nx.DiGraph()
    g.add_nodes_from(range(len(kernels)))
    g.add_edges_from(kernels.edges())
    assert nx.is_directed_acyclic_graph(g)
    # against Inductor's own fusion of the same function: as many kernels, in the same chain
    # (c, mm, a fused with b, mm, d)
    (compiled,) = capture_scheduler_nodes(_two_chains, *_args(), backward=False)
    assert len(kernels) == len(compiled.after) == 5
    assert sorted(g.edges()) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [type(n).__name__ for n in compiled.after] == [
        "SchedulerNode", "ExternKernelSchedulerNode", "FusedSchedulerNode", "ExternKernelSchedulerNode",
        "SchedulerNode"]
