"""A transformer sharded by hand, the way torchtitan's SimpleFSDP works but without any frontend: each
parameter is an ``nn.Parameter`` holding a ``Shard(0)`` DTensor, held directly by plain modules (no
``nn.Linear``), redistributed to ``Replicate`` where it is read, inside ``torch.utils.checkpoint`` with a
selective-checkpoint policy that recomputes the gathers in backward (reshard after forward).  The output
projection is tied to the embedding (read outside the checkpointed blocks), the vocabulary (251) and the
feed-forward width (``3 * dim + 1``) do not divide by the group size (uneven shards, padded inside the graph).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

VOCAB = 251
#: manual per-block plan in the loss module's FQNs, and the blocks the passes should find
PER_BLOCK_PLAN = ["gpt.embed", "gpt.blocks.[0-2]", "gpt.norm"]
BLOCKS = ["gpt.blocks.0", "gpt.blocks.1", "gpt.blocks.2"]


def recompute_gathers(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Gathers (and their waits) recomputed in backward, matmuls saved, the rest left to the partitioner."""
    name = str(op)
    if "all_gather" in name or "wait_tensor" in name:
        return CheckpointPolicy.MUST_RECOMPUTE
    if name.startswith("aten.mm") or name.startswith("aten.addmm"):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def replicated(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(p, DTensor):  # the unsharded reference
        return p
    return p.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * shape[-1] ** -0.5)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        hidden = 3 * dim + 1
        self.norm_scale = nn.Parameter(torch.ones(dim))
        self.w_in = _param(hidden, dim)
        self.b_in = nn.Parameter(torch.zeros(hidden))
        self.w_out = _param(dim, hidden)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.rms_norm(x, x.shape[-1:], replicated(self.norm_scale))
        h = nn.functional.silu(h @ replicated(self.w_in).t() + replicated(self.b_in))
        return x + h @ replicated(self.w_out).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._body, x, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, recompute_gathers))


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = _param(vocab, dim)


class Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))


class GPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 32, n_blocks: int = 3) -> None:
        super().__init__()
        self.embed = Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.norm = Norm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = nn.functional.embedding(ids, replicated(self.embed.weight))
        for block in self.blocks:
            x = block(x)
        x = nn.functional.rms_norm(x, x.shape[-1:], replicated(self.norm.scale))
        return x @ replicated(self.embed.weight).t()  # tied output projection


class Loss(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.gpt(ids).flatten(0, 1), ids.flatten())


def hand_sharded_loss(world_size: int, seed: int = 0, n_blocks: int = 3, shard: bool = True) -> Loss:
    """The loss module over the model, each parameter a ``Shard(0)`` DTensor over the default group (a tied
    parameter stays one parameter); ``shard=False``: the same weights, unsharded (a reference)."""
    torch.manual_seed(seed)
    model = Loss(GPT(n_blocks=n_blocks))
    if shard:
        shard_by_hand(model, world_size)
    return model


def shard_by_hand(model: nn.Module, world_size: int) -> None:
    """Replace each parameter of ``model`` by an ``nn.Parameter`` holding a ``Shard(0)`` DTensor over the default
    group, as a user would without any frontend; a tied parameter stays one parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in done:
                done[id(p)] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
            module.register_parameter(name, done[id(p)])


def token_ids(seed: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
