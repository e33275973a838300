"""``data_parallel`` under the fake process group: parameters, padding, errors, traced collectives, the passes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_passes
from fsdp_passes.frontend import MixedPrecisionPolicy, data_parallel, sharded_params
from fsdp_passes.testing import build_llama, capture_fx_graphs, capture_scheduler_nodes, example_inputs, fsdp_param_of

AG, RS, AR, WAIT = "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "wait_tensor"
LLAMA = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=67, seq_len=8)
LLAMA1 = dict(LLAMA, n_layers=1)  # where one layer shows it all


def _ops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"]


def _count(gm: torch.fx.GraphModule) -> Counter:
    return Counter(n.target._opname for n in _ops(gm))


def test_parameters_are_dtensors_with_the_real_shape_over_padded_equal_shards(fake_pg_factory):
    fake_pg_factory(8, 7)  # 67 rows on 8 ranks: shards of 9 rows, rank 7 owns 4 (rows 63..66) and 5 padding rows
    ref = build_llama(**LLAMA, fsdp=False)
    model = data_parallel(build_llama(**LLAMA, fsdp=False))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for (name, p), (_, full) in zip(model.named_parameters(), ref.named_parameters()):
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor) and p.placements == (Shard(0),), name
        assert p.shape == full.shape, name
        rows = -(-full.shape[0] // 8)
        torch.testing.assert_close(p.to_local(), full.detach()[7 * rows:8 * rows], rtol=0, atol=0)
    out = model.output._fsdp_shards["weight"]
    assert out.storage.shape == (9, 32) and out.info.local_rows == 4
    assert out.storage.data_ptr() == model.output._parameters["weight"].to_local().data_ptr()  # a view, no copy
    assert bool((out.storage[4:] == 0).all())
    # state_dict: real shapes, no padding, no extra keys
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    assert all(sd[k].shape == v.shape for k, v in ref.state_dict().items())
    assert model.output.weight.shape == (67, 32)  # attribute access gathers and drops the padding


def test_eager_backward_fills_param_grad_and_accumulates(fake_pg):
    model = data_parallel(build_llama(**LLAMA, fsdp=False))
    x = example_inputs(model, seed=0)[0]
    model(x).sum().backward()
    p = model.output._parameters["weight"]
    assert isinstance(p.grad, DTensor) and p.grad.shape == p.shape and p.grad.to_local().shape == p.to_local().shape
    assert model.output._fsdp_shards["weight"].storage.grad is None  # handed over, not kept twice
    first = p.grad.to_local().clone()
    model(x).sum().backward()
    # the fake group moves no data, but accumulation is local: the second backward added the same again
    torch.testing.assert_close(p.grad.to_local(), 2 * first)


def test_errors_name_option_module_and_parameter(fake_pg):
    with pytest.raises(ValueError, match="model=NoneType; expected an nn.Module"):
        data_parallel(None)
    with pytest.raises(ValueError, match="mode='zero3'.*fully_shard, hybrid_shard, replicate"):
        data_parallel(nn.Linear(4, 4), mode="zero3")
    with pytest.raises(ValueError, match="reshard_after_forward=2"):
        data_parallel(nn.Linear(4, 4), reshard_after_forward=2)
    with pytest.raises(ValueError, match="reduce_scatter_group='other'"):
        data_parallel(nn.Linear(4, 4), reduce_scatter_group="other")
    with pytest.raises(ValueError, match="mp_policy"):
        data_parallel(nn.Linear(4, 4), mp_policy={"param_dtype": torch.bfloat16})

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.tensor(2.0))

    with pytest.raises(ValueError, match=r"parameter scale of module Scaled is 0-dimensional"):
        data_parallel(Scaled())
    data_parallel(Scaled(), mode="replicate")  # replicate handles scalars

    tied = build_llama(**LLAMA, fsdp=False)
    tied.output.weight = tied.tok_embeddings.weight
    data_parallel(tied, ignored_params={tied.output.weight})  # left unsharded, as asked
    assert not isinstance(tied.output.weight, DTensor) and isinstance(tied.norm._parameters["weight"], DTensor)


def test_fully_shard_calls_carry_over_with_offload_policy_and_shard_placement_fn(fake_pg):
    """``fully_shard``'s offload_policy / shard_placement_fn: their no-op values are accepted (a call ported from
    FSDP2 runs unchanged); what this frontend does not do is a ValueError before any parameter is converted."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    from torch.distributed.tensor import Shard

    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    data_parallel(model, offload_policy=OffloadPolicy(), shard_placement_fn=lambda p: Shard(0) if p.dim() > 1 else None)
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for _, p in model.named_parameters())
    # a negative dim counts from the last, as in fully_shard: -ndim is dim 0; None is fully_shard's default
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    data_parallel(model, shard_placement_fn=lambda p: Shard(-p.dim()), reshard_after_forward=None)
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for _, p in model.named_parameters())
    assert all(state.info.reshard_after_forward for mod in model for state in mod._fsdp_shards.values())

    cases = [
        (dict(offload_policy=CPUOffloadPolicy()), r"offload_policy=CPUOffloadPolicy.*CPU offload is not supported"),
        (dict(offload_policy="cpu"), r"offload_policy='cpu'; expected None or OffloadPolicy\(\)"),
        (dict(shard_placement_fn=lambda p: Shard(-1) if p.dim() > 1 else None),
         r"shard_placement_fn returned Shard\(dim=1\) for parameter 0.weight"),
        (dict(shard_placement_fn=lambda p: Shard(1) if p.dim() > 1 else None),
         r"shard_placement_fn returned Shard\(dim=1\) for parameter 0.weight; only None or Shard\(0\)"),
        (dict(shard_placement_fn=Shard(0)), r"shard_placement_fn=Shard\(dim=0\); expected None or a function"),
        (dict(shard_placement_fn=lambda p: None, mode="replicate"), r"mode='replicate' shards nothing"),
    ]
    for kwargs, message in cases:
        fresh = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        with pytest.raises(ValueError, match=message):
            data_parallel(fresh, **kwargs)
        assert not any(isinstance(p, DTensor) for p in fresh.parameters())  # nothing converted


@pytest.mark.parametrize("earlier", [(), ("tok_embeddings",), ("output",), ("tok_embeddings", "output")],
                         ids=["one_call", "embedding_first", "output_first", "owners_one_by_one"])
def test_a_tied_parameter_is_sharded_once_and_shared_by_its_owners(fake_pg, earlier):
    tied = build_llama(**LLAMA, fsdp=False)
    tied.output.weight = tied.tok_embeddings.weight
    full = tied.output.weight.detach().clone()
    for owner in earlier:  # converted by earlier calls, with their own settings
        data_parallel(getattr(tied, owner), reshard_after_forward=False)
    data_parallel(tied)
    weight = tied.tok_embeddings._parameters["weight"]
    assert isinstance(weight, DTensor) and tied.output._parameters["weight"] is weight
    assert tied.output._fsdp_shards["weight"] is tied.tok_embeddings._fsdp_shards["weight"]
    names = [name for name, _ in tied.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    infos = sharded_params(tied)
    assert "output.weight" not in infos and len(infos) == len(names)
    # named after its first owner, as the traced gather is tagged, whichever owner was converted first
    info = infos["tok_embeddings.weight"]
    assert tied.output._fsdp_shards["weight"].info.fqn == "tok_embeddings.weight"
    assert info.reshard_after_forward is (not earlier)
    # this rank's rows are the parameter's (the gloo test checks what the owners gather and train)
    assert torch.equal(weight.to_local(), full[:weight.to_local().shape[0]])
    sd = tied.state_dict()  # both names, one storage (as for a tied module without sharding)
    assert sd["output.weight"].to_local().data_ptr() == sd["tok_embeddings.weight"].to_local().data_ptr()


def test_a_tied_parameter_survives_a_swapping_conversion(fake_pg):
    # module conversions that swap parameters (torch.__future__'s flag; always for fake tensors) work on the
    # converted owners and keep them tied (docs/frontend.md: convert after the last data_parallel call)
    tied = build_llama(**LLAMA, fsdp=False)
    tied.output.weight = tied.tok_embeddings.weight
    data_parallel(tied.tok_embeddings)
    data_parallel(tied)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        tied.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    weight = tied.tok_embeddings._parameters["weight"]
    assert tied.output._parameters["weight"] is weight and weight.dtype == torch.float64
    assert weight.to_local().data_ptr() == tied.output._fsdp_shards["weight"].storage.data_ptr()


def test_hybrid_needs_2d_mesh_and_fully_shard_1d(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    mesh2 = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match="mode='fully_shard' needs a 1-D mesh.*hybrid_shard"):
        data_parallel(nn.Linear(4, 4), mesh2)
    with pytest.raises(ValueError, match="hybrid_shard"):
        data_parallel(nn.Linear(4, 4), mode="hybrid_shard")
    model = data_parallel(nn.Linear(4, 10), mesh2, mode="hybrid_shard")
    p = model._parameters["weight"]
    assert p.placements == (Replicate(), Shard(0)) and p.to_local().shape == (3, 4)


def test_nested_calls_override_reshard_per_module(fake_pg):
    model = build_llama(**LLAMA, fsdp=False)
    data_parallel(model.layers[0], reshard_after_forward=False)
    data_parallel(model)
    infos = sharded_params(model)
    assert infos["layers.0.attention.wq.weight"].reshard_after_forward is False
    assert infos["layers.1.attention.wq.weight"].reshard_after_forward is True
    graphs = capture_fx_graphs(model, *example_inputs(model))
    regathered = {fsdp_param_of(n) for n in _ops(graphs.backward) if n.target._opname == AG}
    assert regathered and not any(f.startswith("layers.0.") for f in regathered)
    assert any(f.startswith("layers.1.") for f in regathered)
    # the FQNs annotated on the graph are those of the outermost call
    assert {fsdp_param_of(n) for n in _ops(graphs.forward) if n.target._opname == AG} == set(infos)


def test_mixed_precision_cast_before_gather_and_reduce_dtype(fake_pg):
    model = data_parallel(build_llama(**LLAMA1, fsdp=False), reshard_after_forward=False,
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                         output_dtype=torch.float32))
    graphs = capture_fx_graphs(model, *example_inputs(model))
    ags = [n for n in _ops(graphs.forward) if n.target._opname == AG]
    rss = [n for n in _ops(graphs.backward) if n.target._opname == RS]
    assert ags and all(n.meta["val"].dtype == torch.bfloat16 for n in ags)
    assert all(n.args[0].meta["val"].dtype == torch.bfloat16 for n in ags)  # the shard is cast, then gathered
    assert rss and all(n.meta["val"].dtype == torch.float32 for n in rss)
    out = model(*example_inputs(model))
    assert out.dtype == torch.float32


def test_separate_reduce_scatter_group(fake_pg):
    model = data_parallel(build_llama(**LLAMA1, fsdp=False), reduce_scatter_group="separate")
    graphs = capture_fx_graphs(model, *example_inputs(model))
    ag_groups = {n.args[2] for g in (graphs.forward, graphs.backward) for n in _ops(g) if n.target._opname == AG}
    rs_groups = {n.args[3] for n in _ops(graphs.backward) if n.target._opname == RS}
    assert ag_groups == {"0"} and len(rs_groups) == 1 and rs_groups != ag_groups


@pytest.mark.parametrize("world_size", [8, 64])
def test_traced_collectives_and_the_passes_bucket_and_reorder_them(fake_pg_factory, world_size):
    fake_pg_factory(world_size, world_size - 1)
    model = data_parallel(build_llama(**LLAMA, fsdp=False))
    n_params = len(list(model.parameters()))
    graphs = capture_fx_graphs(model, *example_inputs(model))
    fwd, bwd = _count(graphs.forward), _count(graphs.backward)
    assert fwd == {AG: n_params, WAIT: n_params}
    assert bwd[RS] == n_params and 0 < bwd[AG] < n_params and bwd[WAIT] == bwd[AG] + bwd[RS]
    # every gather moves equal shards: output rows = world size x input rows, for padded parameters too
    for n in _ops(graphs.forward):
        if n.target._opname == AG:
            assert n.meta["val"].shape[0] == world_size * n.args[0].meta["val"].shape[0]
            assert n.args[1] == world_size
    fsdp_passes.last_reports(clear=True)
    capture_scheduler_nodes(model, *example_inputs(model),
                            options=dict(bucketing="manual", bucket_plan=["layers.[0-1]"], reorder=True, strict=True,
                                         memory_budget="1GB"))
    reports = fsdp_passes.last_reports()
    fx = {r.graph.split("_")[1]: r for r in reports if r.pass_name == "fx"}
    sched = [r for r in reports if r.pass_name == "scheduler"]
    assert set(fx) == {"fwd", "bwd"} and all(r.fallback is None for r in reports)
    assert all(r.n_collectives_after < r.n_collectives_before for r in fx.values())
    assert sched and sum(r.collectives_moved for r in sched) > 0


def test_graphs_are_the_same_on_every_rank_with_uneven_parameters(fake_pg_factory):
    """67 rows on 8 ranks: rank 0 owns 9 rows, rank 7 owns 4; both trace the same graphs."""
    import contextlib

    from fsdp_passes.testing import fake_process_group

    codes = []
    for rank in (0, 7):
        with contextlib.ExitStack() as stack:
            stack.enter_context(fake_process_group(8, rank))
            model = data_parallel(build_llama(**LLAMA1, fsdp=False))
            graphs = capture_fx_graphs(model, *example_inputs(model, seed=0))
            codes.append((graphs.forward.code, graphs.backward.code,
                          [tuple(n.meta["val"].shape) for n in graphs.forward.graph.nodes if n.op == "placeholder"]))
    assert codes[0] == codes[1]


def test_meta_init_then_to_empty_and_dtype_conversion_keep_the_view(fake_pg):
    with torch.device("meta"):
        model = build_llama(**LLAMA, fsdp=False)
    data_parallel(model)
    state = model.output._fsdp_shards["weight"]
    assert state.storage.is_meta
    param = model.output._parameters["weight"]
    model.to_empty(device="cpu")
    model.double()
    state = model.output._fsdp_shards["weight"]
    assert state.param is param and model.output._parameters["weight"] is param  # optimizers keep their handle
    assert state.storage.device.type == "cpu" and state.storage.dtype == torch.float64 == param.dtype
    assert param.to_local().data_ptr() == state.storage.data_ptr() and state.storage.requires_grad


def test_a_conversion_keeps_param_grad_and_reports_the_new_dtypes(fake_pg):
    model = data_parallel(nn.Linear(4, 16))
    model(torch.randn(2, 4)).sum().backward()
    p = model._parameters["weight"]
    grad = p.grad.to_local().clone()
    model.to(torch.float32)  # a no-op
    model.double()
    # nn.Module converts .grad along with the parameter; re-pointing the parameter at the new shard must keep it
    assert p.grad is not None and p.grad.dtype == torch.float64
    torch.testing.assert_close(p.grad.to_local(), grad.double(), rtol=0, atol=0)
    info = sharded_params(model)["weight"]
    assert info.orig_dtype == info.reduce_dtype == torch.float64  # no mp_policy: reduced in the parameter's dtype
    fixed = data_parallel(nn.Linear(4, 16), mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32)).double()
    assert sharded_params(fixed)["weight"].reduce_dtype == torch.float32  # the policy's, kept


def test_moving_pending_accumulators_to_meta_is_refused_before_anything_moves(fake_pg):
    model = data_parallel(nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 4)))
    model.set_requires_gradient_sync(False)
    model(torch.randn(2, 4)).sum().backward()  # unsynced: no collective, the accumulators hold the gradients
    state = model[0]._fsdp_shards["weight"]
    pending = state.unsharded_sink.grad.clone()
    with pytest.raises(RuntimeError, match=r"parameter 0\.weight holds gradients accumulated without sync .* from "
                                           r"cpu to meta would lose them"):
        model.to("meta")
    assert all(not p.is_meta for p in model.parameters()) and not state.storage.is_meta  # nothing moved
    torch.testing.assert_close(state.unsharded_sink.grad, pending, rtol=0, atol=0)


def test_replacing_a_sharded_parameter_is_refused(fake_pg):
    model = data_parallel(nn.Linear(4, 16))
    model.weight = nn.Parameter(torch.zeros(16, 4))
    with pytest.raises(RuntimeError, match="parameter weight was replaced after sharding"):
        model(torch.randn(2, 4))


def test_replicate_all_reduces_gradients_and_gathers_nothing(fake_pg):
    model = data_parallel(build_llama(**LLAMA1, fsdp=False), mode="replicate")
    p = model.output._parameters["weight"]
    assert p.placements == (Replicate(),) and p.to_local().shape == (67, 32)
    graphs = capture_fx_graphs(model, *example_inputs(model))
    n_params = len(list(model.parameters()))
    assert _count(graphs.forward) == {}
    assert _count(graphs.backward) == {AR: n_params, WAIT: n_params}


def test_gradient_sync_switches_reach_the_calls_they_name_and_check_their_arguments(fake_pg):
    model = build_llama(**LLAMA1, fsdp=False)
    data_parallel(model.layers[0])
    data_parallel(model)
    everything, layer = set(sharded_params(model)), {f for f in sharded_params(model) if f.startswith("layers.0.")}
    assert layer and layer != everything

    def reduced() -> set[str]:  # the parameters whose gradients the traced backward reduce-scatters
        graphs = capture_fx_graphs(model, *example_inputs(model))
        return {fsdp_param_of(n) for n in _ops(graphs.backward) if n.target._opname == RS}

    assert reduced() == everything
    model.set_requires_gradient_sync(False, recurse=False)  # the root call's parameters, not the nested call's
    assert reduced() == layer
    model.set_requires_gradient_sync(False)
    assert reduced() == set()
    with pytest.raises(ValueError, match=r"set_requires_gradient_sync: requires_gradient_sync=1; expected True or"):
        model.set_requires_gradient_sync(1)
    with pytest.raises(ValueError, match=r"set_requires_all_reduce: requires_all_reduce=None; expected True or"):
        model.set_requires_all_reduce(None)
    with pytest.raises(ValueError, match=r"set_requires_gradient_sync: recurse='no'; expected True or False"):
        model.set_requires_gradient_sync(True, recurse="no")
