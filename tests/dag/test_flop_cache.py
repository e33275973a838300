"""An FX node's FLOP count is kept in its meta and reused while the node is the same (``fx_node_flops``): a
graph's DAG is built several times per compile.  Counts are checked against 2*M*N*K computed here."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fsdp_passes.dag.from_fx as from_fx
from fsdp_passes.dag.from_fx import dag_from_fx, fx_node_flops


def _graph() -> torch.fx.GraphModule:
    def f(a, b, c):
        return torch.mm(torch.mm(a, b), c)

    return make_fx(f, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 4))


def _mms(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default]


def _counting(monkeypatch) -> list[int]:
    calls = [0]
    real = from_fx.aten_flops

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(from_fx, "aten_flops", counted)
    return calls


def test_counted_once_while_the_node_is_the_same(monkeypatch):
    gm = _graph()
    first, second = _mms(gm)
    calls = _counting(monkeypatch)
    assert fx_node_flops(first) == 2 * 8 * 16 * 32 and fx_node_flops(second) == 2 * 8 * 32 * 4
    assert calls[0] == 2
    dag = dag_from_fx(gm.graph)
    dag_from_fx(gm.graph)  # built again, as the passes do after bucketing: no count made again
    assert calls[0] == 2
    assert sorted(n.flops for n in dag.nodes if n.flops) == [2 * 8 * 32 * 4, 2 * 8 * 16 * 32]


def test_counted_again_after_a_rewire_or_a_new_value(monkeypatch):
    gm = _graph()
    a, b, _ = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first, second = _mms(gm)
    fx_node_flops(second)
    calls = _counting(monkeypatch)
    # rewired: the second mm now reads a (8 x 16) @ b (16 x 32): its own count, not the cached one
    second.args = (a, b)
    second.meta["val"] = first.meta["val"]
    assert fx_node_flops(second) == 2 * 8 * 16 * 32 and calls[0] == 1
    # a new value with the same arguments (a pass re-propagated shapes): counted again
    second.meta["val"] = torch.empty_like(first.meta["val"])
    fx_node_flops(second)
    assert calls[0] == 2
