"""Tensor parallel under ``data_parallel`` on the fake process group: layouts, errors, and the passes leaving the
tensor-parallel group's collectives as a compile without them has them.  Numerics: test_frontend_tp_gloo.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp_passes
from fsdp_passes.frontend import data_parallel, sharded_params
from fsdp_passes.testing.models import build_sequence_parallel_lm, sequence_parallel_plan


def _lm(mesh, vocab: int = 22):
    model = build_sequence_parallel_lm(vocab)
    parallelize_module(model, mesh["tp"], sequence_parallel_plan(model))
    return data_parallel(model, mesh["dp"])


def test_the_gathered_part_is_the_tensor_parallel_local_part(fake_pg):
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))  # rank 0: dp 0, tp 0
    model = _lm(mesh)
    infos = sharded_params(model)
    out = infos["output.weight"]  # (22, 16), ColwiseParallel: 11 rows on tp rank 0, 3 per dp rank (padded)
    assert (out.full_shape, out.gathered_shape, out.shard_shape, out.local_rows) == ((22, 16), (11, 16), (3, 16), 3)
    assert out.tensor_parallel == (Shard(0),) and out.world_size == 4
    assert out.group_name == mesh.get_group(0).group_name
    w2 = infos["layers.0.ffn.w2.weight"]  # (16, 24), RowwiseParallel: columns split by tp, rows by dp
    assert (w2.gathered_shape, w2.shard_shape, w2.tensor_parallel) == ((16, 12), (4, 12), (Shard(1),))
    p = model.output._parameters["weight"]
    assert p.shape == (22, 16) and p.to_local().shape == (3, 16)
    assert p.device_mesh.mesh_dim_names == ("dp", "tp") and p.placements == (_StridedShard(0, split_factor=2), Shard(0))
    # read outside forward: the module's view, a DTensor on the tp mesh with the tensor-parallel placement
    gathered = model.output.weight
    assert isinstance(gathered, DTensor) and gathered.placements == (Shard(0),)
    assert gathered.device_mesh == mesh["tp"] and gathered.to_local().shape == (11, 16) and gathered.shape == (22, 16)


def test_dtensors_it_cannot_shard_further_are_value_errors(fake_pg):
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))

    def with_weight(value: DTensor) -> nn.Linear:
        lin = nn.Linear(4, 4)
        lin.weight = nn.Parameter(value)
        return lin

    full = torch.randn(4, 4)
    on_2d = with_weight(distribute_tensor(full, mesh, (Replicate(), Shard(0))))
    with pytest.raises(ValueError, match=r"parameter weight of module Linear is a DTensor on a 2-D mesh.*1-D tensor-"):
        data_parallel(on_2d, mesh["dp"])
    partial = with_weight(DTensor.from_local(full, mesh["tp"], (Partial(),)))
    with pytest.raises(ValueError, match=r"weight .* placement Partial\(sum\); supported .* Shard\(dim\), Replicate"):
        data_parallel(partial, mesh["dp"])
    on_dp = with_weight(distribute_tensor(full, mesh["dp"], (Shard(0),)))
    with pytest.raises(ValueError, match=r"does not combine with mesh=.*distinct named dimensions of one DeviceMesh"):
        data_parallel(on_dp, mesh["dp"])
    other_root = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    elsewhere = with_weight(distribute_tensor(full, other_root, (Replicate(),)))
    with pytest.raises(ValueError, match=r"does not combine with mesh="):
        data_parallel(elsewhere, mesh["dp"])


@pytest.mark.parametrize("world_size, shape, vocab, seq", [(8, (4, 2), 22, 8), (64, (8, 8), 64, 16)])
def test_the_passes_keep_the_tensor_parallel_collectives_and_merge_the_data_parallel_ones(
        fake_pg_factory, fresh_inductor, world_size, shape, vocab, seq):
    """dp 4 x tp 2 (fake world 8) and dp 8 x tp 8 (64), ``fsdp_passes.enable()``'s defaults: each graph's tp-group
    collectives (all-gathers, reduce-scatters and all-reduces of activations and of the replicated parameters'
    gradients) are the same ops, payloads and order as in a compile without the passes; the dp group's are merged
    into fewer."""
    from fsdp_passes.testing.end_to_end import measure_compile

    fake_pg_factory(world_size, 0)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group(0).group_name, mesh.get_group(1).group_name
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    sequences = {}
    for name, options in (("without", None), ("with", {})):
        fsdp_passes.last_reports(clear=True)
        sequences[name] = {m.graph_name: m.sequences
                           for m in measure_compile(_lm(mesh, vocab), tokens, options=options)}
        torch._dynamo.reset()
    assert not [r.fallback for r in fsdp_passes.last_reports() if r.fallback]
    assert set(sequences["with"]) == set(sequences["without"]) == {"forward", "backward"}
    for graph in ("forward", "backward"):
        with_, without = sequences["with"][graph], sequences["without"][graph]
        assert with_[tp] == without[tp] and len(without[tp]) >= 3, (graph, with_[tp], without[tp])
        assert len(with_[dp]) < len(without[dp]), (graph, with_[dp], without[dp])


def test_pipeline_stages_of_the_sequence_parallel_lm():
    from fsdp_passes.testing.models import sequence_parallel_lm_stage

    full = build_sequence_parallel_lm(n_layers=4)
    first = sequence_parallel_lm_stage(build_sequence_parallel_lm(n_layers=4), 0, 2)
    last = sequence_parallel_lm_stage(build_sequence_parallel_lm(n_layers=4), 1, 2)
    assert first.norm is None and first.output is None and last.embed is None and len(last.layers) == 2
    # the stages' plans name only what each stage holds
    first_plan, last_plan = set(sequence_parallel_plan(first)), set(sequence_parallel_plan(last))
    assert {"embed", "layers.1.ffn.w2"} <= first_plan and not {"norm", "output"} & first_plan
    assert {"norm", "output", "layers.1.ffn.w2"} <= last_plan and "embed" not in last_plan
    tokens = torch.randint(0, 22, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(last(first(tokens)), full(tokens))
    with pytest.raises(ValueError, match="stage=2; expected 0 <= stage < n_stages=2"):
        sequence_parallel_lm_stage(build_sequence_parallel_lm(n_layers=4), 2, 2)
    with pytest.raises(ValueError, match="n_stages=3 does not divide the model's 4 layers"):
        sequence_parallel_lm_stage(build_sequence_parallel_lm(n_layers=4), 0, 3)
