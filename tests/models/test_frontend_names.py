"""Collectives named and blocks found whatever put the collectives in the graph.

Unit level: Dynamo's ways of writing a module path (root variables, ``_modules`` containers, property-closure
sources of parametrization frontends, torchtitan's ``module_fqn`` annotation).  Graph level, on a fake 8-rank
group at rank 7 (where uneven shards are padded before their gather): a GPT written with plain DTensor
parameters (``Shard(0)``, redistributed to ``Replicate`` in forward, blocks in an ``nn.ModuleList``), inside
a loss module, with its output projection tied to the embedding: a manual per-block plan with ``strict=True``
names every collective after the compiled module's parameters and modules, finds the blocks, and buckets the
padded gathers like the others.  And the warning when a graph reads parameters but traces no collective.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fsdp_passes
from fsdp_passes.dag.from_fx import module_fqn, normalize_module_path, stack_parameter
from fsdp_passes.testing import capture_fx_graphs, fake_process_group

# the hand-sharding helper and the loss module live beside this file (test modules are imported by path)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hand_sharded import Loss, shard_by_hand  # noqa: E402

CLOSURE = "dict(type(L['self'].lm.model.embed_tokens).__dict__)['weight'].fget.__closure__[0].cell_contents"


@pytest.mark.parametrize("raw, expected", [
    ("L['self']._modules['lm']._modules['model']._modules['layers']._modules['3']._parameters['weight']",
     "lm.model.layers.3.weight"),
    ("G['model'].layers.0.attention_norm", "layers.0.attention_norm"),
    ("L.self.lm.model.embed_tokens", "lm.model.embed_tokens"),
    ("L['self']._orig_mod.h[2]", "h.2"),
])
def test_dynamo_paths_in_the_compiled_modules_naming(raw, expected):
    assert normalize_module_path(raw) == expected


def _node(**meta) -> fx.Node:
    g = fx.Graph()
    node = g.call_function(torch.relu, (g.placeholder("x"),))
    node.meta.update(meta)
    return node


def test_module_stack_skips_property_closures_and_prefers_annotations():
    stack = {"a": ("L['self']", object), "b": ("L['self'].lm.model.embed_tokens", object), "c@3": (CLOSURE, object)}
    # the parametrization object is reached through a closure (possibly of another module of the same class):
    # the module that read the parameter is the answer, and the getter's name completes the parameter
    assert module_fqn(_node(nn_module_stack=stack)) == "lm.model.embed_tokens"
    assert stack_parameter(_node(nn_module_stack=stack)) == "lm.model.embed_tokens.weight"
    assert stack_parameter(_node(fwd_nn_module_stack=stack)) == "lm.model.embed_tokens.weight"
    assert module_fqn(_node(nn_module_stack=stack, custom={"module_fqn": "model.embed_tokens"})) == "model.embed_tokens"
    assert stack_parameter(_node(nn_module_stack={"a": ("L['self'].norm", object)})) is None


# -- a GPT with plain DTensor parameters -----------------------------------------------------------------------

def _replicated(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import Partial, Replicate

    return p.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim + 1)  # 3 * dim + 1 rows: uneven shards
        self.down = nn.Linear(3 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.layer_norm(x, x.shape[-1:], _replicated(self.norm.weight), _replicated(self.norm.bias))
        h = nn.functional.linear(h, _replicated(self.up.weight), _replicated(self.up.bias)).relu()
        return x + nn.functional.linear(h, _replicated(self.down.weight), _replicated(self.down.bias))


class Head(nn.Module):
    def __init__(self, tied: nn.Parameter) -> None:
        super().__init__()
        self.weight = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ _replicated(self.weight).t()


class GPT(nn.Module):
    def __init__(self, vocab: int = 251, dim: int = 32, n_blocks: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = Head(self.wte.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = nn.functional.embedding(ids, _replicated(self.wte.weight))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_plain_dtensor_gpt_names_blocks_tied_and_uneven_shards():
    plan = ["gpt.wte", "gpt.blocks.[0-1]"]
    with fake_process_group(world_size=8, rank=7):
        torch.manual_seed(0)
        model = Loss(GPT())
        shard_by_hand(model, 8)
        fsdp_passes.last_reports(clear=True)
        graphs = capture_fx_graphs(model, torch.randint(0, 251, (2, 8)),
                                   options=dict(bucketing="manual", bucket_plan=plan, strict=True, memory_budget="1GB"))
        reports = [r for r in fsdp_passes.last_reports() if r.pass_name == "fx"]
    assert [r.fallback for r in reports] == [None, None]
    params = {n for n, _ in model.named_parameters()}
    fwd, bwd = (r.extra["bucketing"] for r in reports)
    for b in (fwd, bwd):
        assert b["unattributed"] == {} and b["unbucketed"] == {}
        assert all(who["param"] in params for who in b["attribution"].values()), b["attribution"]
        assert sorted(b["blocks"]) == ["gpt.blocks.0", "gpt.blocks.1"]
    # the tied weight: one gather in forward (the two reads of one input are one gather once traced), and two
    # gradient contributions reduce-scattered in backward, one from the head; all under the parameter's name
    assert [w["module"] for w in fwd["attribution"].values() if w["param"] == "gpt.wte.weight"] == ["gpt"]
    tied = {k: w["module"] for k, w in bwd["attribution"].items() if w["param"] == "gpt.wte.weight"}
    assert sorted(tied.values()) == ["gpt", "gpt.head"]
    wte_bucket = next(k for k in bwd["buckets"] if k["label"] == "gpt.wte")
    assert sorted(wte_bucket["members"]) == sorted(tied)
    # rank 7 holds padded shards of the 251-row embedding and the 97-row layers: their gathers take the padded
    # shard and are bucketed like the others
    padded = {n.name for n in graphs.forward.graph.nodes if "all_gather" in str(n.target)
              and "constant_pad_nd" in str(n.args[0].target)}
    assert len(padded) == 5
    merged = {m for k in fwd["buckets"] if len(k["members"]) > 1 for m in k["members"]}
    assert len(padded & merged) == 4  # the layers' four (the embedding's gather is alone in its entry)
    assert [r.n_collectives_after for r in reports] == [3, 3]  # wte, blocks.0, blocks.1


# -- nothing traced -------------------------------------------------------------------------------------------

def test_one_warning_when_a_graph_reads_parameters_but_traces_no_collective():
    from fsdp_passes.inductor import param_names

    param_names._warn_no_collective_once.cache_clear()
    with fake_process_group(world_size=8):
        plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                capture_fx_graphs(plain, torch.randn(2, 8), options=dict(bucketing="auto"))
        said = [w for w in caught if "no collective was traced" in str(w.message)]
        assert len(said) == 1
        assert "fully_shard" in str(said[0].message) and "SimpleFSDP" in str(said[0].message)

        # a frontend that gathers in the graph: no warning
        param_names._warn_no_collective_once.cache_clear()
        sharded = Loss(GPT(n_blocks=1))
        shard_by_hand(sharded, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            capture_fx_graphs(sharded, torch.randint(0, 251, (2, 8)), options=dict(bucketing="none"))
        assert not [w for w in caught if "no collective was traced" in str(w.message)]

    # one process: no group of more than one rank, nothing to say
    param_names._warn_no_collective_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capture_fx_graphs(plain, torch.randn(2, 8), options=dict(bucketing="auto"))
    assert not [w for w in caught if "no collective was traced" in str(w.message)]


def test_pre_grad_pass_installed_chained_and_restored():
    import torch._inductor.config as ic

    from fsdp_passes.inductor.param_names import ParamNamesPass

    seen = []

    class UserPass:
        def __call__(self, graph):
            seen.append(graph)

        def uuid(self):
            return "user"

    user = UserPass()
    saved = ic.pre_grad_custom_pass
    ic.pre_grad_custom_pass = user
    try:
        with fsdp_passes.enabled(bucketing="none"):
            ours = ic.pre_grad_custom_pass
            assert isinstance(ours, ParamNamesPass) and ours.chained is user
            g = fx.Graph()
            g.output(g.placeholder("x"))
            ours(g)
            assert seen == [g]  # the user's pass still runs, after ours
            assert ours.uuid() != ParamNamesPass().uuid()  # the chained pass is part of the cache key
        assert ic.pre_grad_custom_pass is user
    finally:
        ic.pre_grad_custom_pass = saved


def test_collectives_inside_traced_autograd_function_subgraphs_count():
    """An ``autograd.Function`` (this package's HSDP helpers) is traced into a subgraph module of Dynamo's graph:
    its collectives are there, not at the top level, and the graph is not reported as collective-free."""
    from types import SimpleNamespace

    from fsdp_passes.inductor.param_names import parameter_fqns, traces_no_collective

    def graph_module(with_collective: bool) -> fx.GraphModule:
        sub = fx.Graph()
        x = sub.placeholder("x")
        y = (sub.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 8, "0"))
             if with_collective else sub.call_function(torch.relu, (x,)))
        sub.output(y)
        root = nn.Module()
        root.fwd_body = fx.GraphModule(nn.Module(), sub)
        g = fx.Graph()
        w = g.placeholder("l_self_parameters_weight_")
        w.meta["grapharg"] = SimpleNamespace(source=SimpleNamespace(name="L['self']._modules['fc']._parameters['weight']"))
        w.meta["example_value"] = torch.zeros(2)
        body = g.get_attr("fwd_body")
        g.output(g.call_function(torch.ops.higher_order.autograd_function_apply, (body, body, w)))
        return fx.GraphModule(root, g)

    with_collective, without = graph_module(True), graph_module(False)
    assert list(parameter_fqns(with_collective.graph).values()) == ["fc.weight"]
    assert not traces_no_collective(with_collective.graph)
    assert traces_no_collective(without.graph)
