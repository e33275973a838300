"""A small language model whose backward collectives AOT autograd's partitioner used to choose by the local shape.

Two tables are read outside the blocks: the token table by an index lookup ``tok[ids]`` and by the tied logits
``x @ tok.t()``; the position table, tied too, by two lookups ``pos[positions]``, added to the input and again
before the final norm.  The backward needs neither lookup's table (an index's gradient is a scatter-add), so
with the tables resharded after forward (gathers recomputed in backward) the position table is gathered in
backward only if the partitioner recomputes a lookup instead of saving it.  It bans recomputing an op whose
output is 4x smaller than its inputs: the lookups were saved while ``tokens * 4 < table rows`` (64 tokens
here) and recomputed, with one more all-gather, above: ranks with different local batches compiled different
backward graphs (18 collectives at 2 x 16 tokens, 19 at 16 x 16, ``data_parallel``).

Three frontends build the same model (``FRONTENDS``): ``fsdp_passes.data_parallel``, torchtitan's SimpleFSDP,
and by hand (``Shard(0)`` DTensor parameters redistributed inside a per-parameter selective checkpoint, as
SimpleFSDP does).  Block parameters are read inside the blocks; the vocabulary (250) and the feed-forward width
do not divide by 8 (padded shards).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 250
DIM = 64
POSITIONS = 250
FRONTENDS = ("data_parallel", "torchtitan", "hand_sharded")
#: manual per-block plan in the model's FQNs
PER_BLOCK_PLAN = [["tok", "pos"], "blocks.[0-1]", "norm"]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim + 1)
        self.down = nn.Linear(3 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TiedLookupLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, n_blocks: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(POSITIONS, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        # lookups as an index (recomputable), not F.embedding
        x = self.tok.weight[ids] + self.pos.weight[positions]
        for block in self.blocks:
            x = block(x)
        x = x + self.pos.weight[positions]
        logits = self.norm(x) @ self.tok.weight.t()  # tied output projection
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _recompute_gathers(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    name = str(op)
    if "all_gather" in name or "wait_tensor" in name or "_to_copy" in name or "slice" in name:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _gathered(p: nn.Parameter) -> torch.Tensor:
    from torch.distributed.tensor import Partial, Replicate

    return p.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])


class _HandGathered(nn.Module):
    """Parametrization: the ``Shard(0)`` DTensor parameter read as its gathered local tensor, the gather
    recomputed in backward (reshard after forward)."""

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        return checkpoint(_gathered, p, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_gathers))


def _shard_by_hand(model: nn.Module, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn.utils import parametrize

    mesh = init_device_mesh("cpu", (world_size,))
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
            parametrize.register_parametrization(module, name, _HandGathered(), unsafe=True)


def build(frontend: str, world_size: int, seed: int = 0) -> nn.Module:
    """The model with every parameter sharded over the default group by ``frontend`` (one of ``FRONTENDS``;
    ``"none"``: unsharded, the reference)."""
    torch.manual_seed(seed)
    model = TiedLookupLM()
    if frontend == "data_parallel":
        import fsdp_passes

        for block in model.blocks:
            fsdp_passes.data_parallel(block)
        fsdp_passes.data_parallel(model)
    elif frontend == "torchtitan":
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

        model = data_parallel(model, init_device_mesh("cpu", (world_size,)), mode="fully_shard")
    elif frontend == "hand_sharded":
        _shard_by_hand(model, world_size)
    elif frontend != "none":
        raise ValueError(f"frontend={frontend!r}; allowed: {', '.join(FRONTENDS)}, none")
    return model


def token_ids(seed: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
