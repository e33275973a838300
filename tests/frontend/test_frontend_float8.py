"""``data_parallel(float8_all_gather=True)`` on a fake world of 8: what the traced graphs gather, and how the
passes bucket it.

Bytes are counted from the captured post-grad graphs' all-gather nodes (``meta["val"]``, before the passes
ran) and compared with the sizes worked out from the unsharded model's Linear weights.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn as nn

import fsdp_passes
from fsdp_passes import MixedPrecisionPolicy, data_parallel
from fsdp_passes.dag.from_fx import dag_from_fx
from fsdp_passes.dag.graph import CollectiveOp
from fsdp_passes.frontend import sharded_params
from fsdp_passes.testing import build_llama, capture_fx_graphs, fake_process_group

WORLD = 8
# vocab 67: the output weight's rows do not divide by 8 (a padded shard, 9 rows on every rank)
LLAMA = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=67, seq_len=8)
PASSES = dict(bucketing="auto", reorder=True, strict=True)


@pytest.fixture(autouse=True)
def _fresh():
    import torch._dynamo
    import torch._inductor.config as ic

    ic.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.reset()
    fsdp_passes.last_reports(clear=True)
    yield
    fsdp_passes.disable()


def _llama(float8: bool) -> nn.Module:
    model = build_llama(**LLAMA, fsdp=False)
    return data_parallel(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                         float8_all_gather=float8)


def _linear_weight_shapes() -> list[tuple[int, int]]:
    return [tuple(m.weight.shape) for m in build_llama(**LLAMA, fsdp=False).modules() if isinstance(m, nn.Linear)]


def _gather_bytes(graph: torch.fx.GraphModule) -> dict[torch.dtype, list[int]]:
    out: dict[torch.dtype, list[int]] = {}
    for n in graph.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
            val = n.meta["val"]
            out.setdefault(val.dtype, []).append(val.numel() * val.element_size())
    return out


def _tokens() -> torch.Tensor:
    return torch.randint(0, LLAMA["vocab"], (2, LLAMA["seq_len"]), generator=torch.Generator().manual_seed(0))


def test_only_linear_weights_are_gathered_in_float8():
    with fake_process_group(world_size=WORLD):
        flags = {fqn: info.float8_all_gather for fqn, info in sharded_params(_llama(True)).items()}
    linear = {f"{name}.weight" for name, m in build_llama(**LLAMA, fsdp=False).named_modules()
              if isinstance(m, nn.Linear)}
    assert linear and {f for f, on in flags.items() if on} == linear
    assert "tok_embeddings.weight" in flags and not flags["tok_embeddings.weight"]


def test_forward_gather_bytes_halve_and_float8_gathers_bucket():
    with fake_process_group(world_size=WORLD):
        bf16 = capture_fx_graphs(_llama(False), _tokens(), options=PASSES)
        bf16_reports = fsdp_passes.last_reports(clear=True)
        f8 = capture_fx_graphs(_llama(True), _tokens(), options=PASSES)
        f8_reports = fsdp_passes.last_reports(clear=True)

    # expected from the unsharded model: each Linear weight's padded shard (ceil(rows / 8) rows) in float8,
    # 1 byte per element, padded to 4 bytes, then its float32 scale; in bf16, 2 bytes per element
    shapes = _linear_weight_shapes()
    shard_numel = [math.ceil(r / WORLD) * c for r, c in shapes]
    want_f8 = sorted(WORLD * (n + (-n % 4) + 4) for n in shard_numel)
    want_bf16_linear = sum(WORLD * 2 * n for n in shard_numel)

    got_bf16, got_f8 = _gather_bytes(bf16.forward), _gather_bytes(f8.forward)
    assert sorted(got_f8[torch.uint8]) == want_f8
    # the other parameters (embedding, norms) are gathered in bf16 as before
    assert sum(got_f8[torch.bfloat16]) == sum(got_bf16[torch.bfloat16]) - want_bf16_linear
    # half the bf16 bytes, plus each rank's scale (4 bytes) and alignment padding per weight
    overhead = sum(WORLD * (-n % 4 + 4) for n in shard_numel)
    assert 2 * (sum(got_f8[torch.uint8]) - overhead) == want_bf16_linear
    # reshard after forward: backward gathers the Linear weights again, in float8 too
    assert set(_gather_bytes(f8.backward)) == {torch.uint8, torch.bfloat16}

    fwd = [r for r in f8_reports if r.pass_name == "fx" and "_fwd_" in r.graph]
    assert len(fwd) == 1 and fwd[0].fallback is None
    assert fwd[0].n_collectives_after < fwd[0].n_collectives_before == sum(map(len, got_f8.values()))
    buckets = fwd[0].extra["bucketing"]["buckets"]
    merged_f8 = [b for b in buckets if b["dtype"] == "uint8" and len(b["members"]) > 1]
    assert merged_f8, buckets
    # one dtype per bucket: float8 gathers bucket among themselves
    assert all(b["dtype"] in ("uint8", "bfloat16") for b in buckets if b["op"] == "all_gather")
    bf16_fwd = [r for r in bf16_reports if r.pass_name == "fx" and "_fwd_" in r.graph]
    assert bf16_fwd[0].n_collectives_before == sum(map(len, got_bf16.values()))


def test_float8_gathers_are_fsdp_and_priced_by_their_bytes():
    with fake_process_group(world_size=WORLD):
        f8 = capture_fx_graphs(_llama(True), _tokens())
    dag = dag_from_fx(f8.forward)
    gathers = [n for n in dag.nodes if n.collective is CollectiveOp.ALL_GATHER]
    bytes_by_name = {}
    for n in f8.forward.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
            bytes_by_name[n.name] = n.meta["val"].numel() * n.meta["val"].element_size()
    assert sum(n.dtype == "uint8" for n in gathers) == len(_linear_weight_shapes())
    for n in gathers:
        assert n.fsdp, n.name
        assert n.comm_bytes == bytes_by_name[n.name], n.name


def test_bad_float8_option_is_a_value_error():
    with fake_process_group(world_size=WORLD):
        with pytest.raises(ValueError, match="float8_all_gather='yes'"):
            data_parallel(build_llama(**LLAMA, fsdp=False), float8_all_gather="yes")
        with pytest.raises(ValueError, match="float8_all_gather=True but mode='replicate'"):
            data_parallel(build_llama(**LLAMA, fsdp=False), mode="replicate", float8_all_gather=True)


def test_float8_on_a_call_that_gathers_no_linear_weight_in_float8_warns_once():
    import warnings

    with fake_process_group(world_size=WORLD):
        with pytest.warns(UserWarning) as caught:
            data_parallel(nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8)), float8_all_gather=True)
        assert len(caught) == 1
        assert re.search(r"data_parallel\(Sequential, float8_all_gather=True\): no parameter is gathered in "
                         r"float8.*this call converted 0\.weight, 1\.weight, 1\.bias \(3\), no nn\.Linear weight",
                         str(caught[0].message)), str(caught[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # a call with Linear weights; a root call that converts only an embedding and a norm over blocks an
            # earlier call gathers in float8 (as torchtitan applies fully_shard per block, then to the root)
            data_parallel(nn.Linear(8, 8), float8_all_gather=True)
            model = nn.Sequential(nn.Embedding(10, 8), nn.Sequential(nn.Linear(8, 8)), nn.LayerNorm(8))
            data_parallel(model[1], float8_all_gather=True)
            data_parallel(model, float8_all_gather=True)


def test_a_float8_gather_of_computed_values_is_not_fsdp():
    funcol = torch.ops._c10d_functional

    def to_bytes(t: torch.Tensor) -> torch.Tensor:
        scale = 448.0 / t.abs().amax().clamp(min=1e-12)
        return (t * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)

    def step(shard: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = funcol.wait_tensor(funcol.all_gather_into_tensor(to_bytes(shard), WORLD, "0"))
        acts = funcol.wait_tensor(funcol.all_gather_into_tensor(to_bytes(x @ x.t()), WORLD, "0"))
        return weight, acts

    with fake_process_group(world_size=WORLD):
        graphs = capture_fx_graphs(step, torch.randn(4, 8), torch.randn(4, 8), backward=False)
    gathers = [n for n in dag_from_fx(graphs.forward).nodes if n.collective is CollectiveOp.ALL_GATHER]
    assert [n.dtype for n in gathers] == ["uint8", "uint8"]
    # the shard's (a graph input, scaled) is a parameter gather; the matmul output's is not
    assert [n.fsdp for n in gathers] == [True, False]


def test_hybrid_shard_gathers_float8_over_the_shard_group():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(world_size=WORLD):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        model = data_parallel(build_llama(**LLAMA, fsdp=False), mesh, mode="hybrid_shard", float8_all_gather=True)
        shard_group = mesh.get_group(1).group_name
        graphs = capture_fx_graphs(model, _tokens(), options=PASSES)
    gathers = [n for n in graphs.forward.graph.nodes
               if n.op == "call_function" and n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    float8 = [n for n in gathers if n.meta["val"].dtype == torch.uint8]
    assert len(float8) == len(_linear_weight_shapes())
    # (shard, group size 4, the shard dimension's group): every rank of a replica sends its own shard
    assert {(n.args[1], n.args[2]) for n in float8} == {(4, shard_group)}
    fwd = [r for r in fsdp_passes.last_reports() if r.pass_name == "fx" and "_fwd_" in r.graph]
    assert fwd[0].fallback is None and fwd[0].n_collectives_after < fwd[0].n_collectives_before
