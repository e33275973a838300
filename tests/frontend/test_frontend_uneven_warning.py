"""The FX pass warns once per process when a graph's FSDP shards differ from the collective's even split."""

from __future__ import annotations

import logging

import torch

import fsdp_passes
from fsdp_passes.inductor import shard_shapes
from fsdp_passes.testing import build_llama, capture_fx_graphs, fake_process_group


class _UnevenDTensorLinear(torch.nn.Module):
    """Another frontend's style: this rank's unpadded ``Shard(0)`` rows, gathered by ``DTensor.redistribute``."""

    def __init__(self, mesh, rows: int, full_rows: int) -> None:
        super().__init__()
        self.mesh, self.full_rows = mesh, full_rows
        self.w = torch.nn.Parameter(torch.randn(rows, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        d = DTensor.from_local(self.w, self.mesh, [Shard(0)], run_check=False,
                               shape=torch.Size([self.full_rows, 16]), stride=(16, 1))
        return x @ d.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()]).t()


def test_uneven_unpadded_shards_warn_once_padded_ones_do_not(caplog):
    from torch.distributed.device_mesh import init_device_mesh

    message = "differ in shape from their collective's even split"
    shard_shapes._warn_once.cache_clear()
    with fake_process_group(8, 7):  # 67 rows on 8 ranks: rank 7 holds 4 rows, the even split is 9
        mesh = init_device_mesh("cpu", (8,))
        padded = fsdp_passes.data_parallel(build_llama(1, 32, 4, 2, 64, vocab=67, seq_len=8, fsdp=False))
        with fsdp_passes.enabled(bucketing="auto", reorder=False), caplog.at_level(logging.WARNING, "fsdp_passes"):
            ours = capture_fx_graphs(padded, torch.randint(0, 67, (2, 8)))
            assert not any(message in r.getMessage() for r in caplog.records)
            theirs = capture_fx_graphs(_UnevenDTensorLinear(mesh, 4, 67), torch.randn(2, 16))
            capture_fx_graphs(_UnevenDTensorLinear(mesh, 4, 67), torch.randn(2, 16))
    assert sum(message in r.getMessage() for r in caplog.records) == 1  # once, for four uneven graphs
    assert shard_shapes.has_uneven_shards(theirs.forward.graph) and shard_shapes.has_uneven_shards(theirs.backward.graph)
    assert not shard_shapes.has_uneven_shards(ours.forward.graph)
    assert not shard_shapes.has_uneven_shards(ours.backward.graph)
