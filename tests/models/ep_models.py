"""A small expert-parallel mixture-of-experts model: experts sharded over an expert-parallel group, tokens
dispatched to them and combined back by all-to-all.

Top-1 routing with a fixed capacity (GShard style): each rank's tokens fill ``capacity`` slots per expert (later
tokens of a full expert pass through the residual only), so every all-to-all has static, equal splits and the
whole step compiles as one graph.  Block ``i`` has capacity ``CAPACITY + i``, so each block's all-to-alls have a
size of their own and a per-group sequence (op, group, bytes) tells the blocks' all-to-alls apart.

With ``ep_group=None`` every expert is local and nothing is exchanged: the unsharded reference, which computes
the same function of each rank's tokens as the expert-parallel model.

Layout on ``ep`` ranks with ``E`` experts: rank ``r`` holds experts ``r * E / ep ...``; a rank's dispatch buffer
``[E, capacity, dim]`` is exchanged so that each rank receives, from every rank, the slots of its own experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

N_EXPERTS, DIM, HIDDEN, CAPACITY = 4, 16, 32, 6


class Experts(nn.Module):
    """``n_local`` two-layer MLP experts as stacked weights (``w1 [n, dim, hidden]``, ``w2 [n, hidden, dim]``)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w1 = nn.Parameter(w1.clone())
        self.w2 = nn.Parameter(w2.clone())

    def forward(self, slots: torch.Tensor) -> torch.Tensor:  # [n_local, tokens, dim]
        return torch.bmm(F.relu(torch.bmm(slots, self.w1)), self.w2)


class MoEBlock(nn.Module):
    """``x + proj(x)`` then ``+ moe(...)``: a dense projection, a router and this rank's experts."""

    def __init__(self, ep_group: Any, ep_rank: int, ep_size: int, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.proj = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, N_EXPERTS, bias=False)
        w1 = torch.randn(N_EXPERTS, DIM, HIDDEN) / DIM ** 0.5
        w2 = torch.randn(N_EXPERTS, HIDDEN, DIM) / HIDDEN ** 0.5
        per = N_EXPERTS // ep_size
        self.experts = Experts(w1[ep_rank * per:(ep_rank + 1) * per], w2[ep_rank * per:(ep_rank + 1) * per])
        self.ep_group = ep_group
        self.ep_size = ep_size

    def _exchange(self, buf: torch.Tensor) -> torch.Tensor:
        """Dim 0 of ``buf`` split in ``ep_size`` equal parts: part ``i`` goes to rank ``i``, part ``i`` of the
        result came from rank ``i`` (the same all-to-all dispatches and combines; autograd's backward is
        another all-to-all)."""
        if self.ep_group is None:
            return buf
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        return all_to_all_single_autograd(buf.contiguous(), None, None, self.ep_group)

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        probs = F.softmax(self.router(tokens), dim=-1)
        gate, expert = probs.max(dim=-1)
        onehot = F.one_hot(expert, N_EXPERTS).to(tokens.dtype)  # [T, E]
        slot = (torch.cumsum(onehot, dim=0) - 1) * onehot  # each token's slot in its expert's queue
        kept = onehot * (slot < self.capacity).to(tokens.dtype)
        in_slot = F.one_hot(slot.long().clamp(0, self.capacity - 1), self.capacity).to(tokens.dtype)
        dispatch = kept.unsqueeze(-1) * in_slot  # [T, E, C]: token t in slot c of expert e
        slots = torch.einsum("tec,td->ecd", dispatch, tokens)  # [E, C, dim], expert-major
        per = N_EXPERTS // self.ep_size
        # [ep (destination), per, C, dim] -> [ep (source), per, C, dim] -> experts over every source's slots
        received = self._exchange(slots).reshape(self.ep_size, per, self.capacity, DIM)
        out = self.experts(received.transpose(0, 1).reshape(per, self.ep_size * self.capacity, DIM))
        out = out.reshape(per, self.ep_size, self.capacity, DIM).transpose(0, 1)
        out = out.reshape(N_EXPERTS, self.capacity, DIM)
        combined = self._exchange(out)  # back to the tokens' ranks, expert-major again
        y = torch.einsum("tec,ecd->td", dispatch, combined) * gate.unsqueeze(-1)
        return y.reshape(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + F.relu(self.proj(x))
        return h + self.moe(h)


class EPModel(nn.Module):
    """``layers.<i>`` MoE blocks, then a linear ``head``; input ``[batch, seq, DIM]``."""

    def __init__(self, n_layers: int, ep_group: Any = None, ep_rank: int = 0, ep_size: int = 1,
                 seed: int = 0) -> None:
        super().__init__()
        if N_EXPERTS % ep_size:
            raise ValueError(f"ep_size={ep_size}: must divide the {N_EXPERTS} experts")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # every rank draws all experts' weights and keeps its own
            self.layers = nn.ModuleList(MoEBlock(ep_group, ep_rank, ep_size, CAPACITY + i) for i in range(n_layers))
            self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def expert_parallel(n_layers: int, mesh: Any, world_mesh: Any, seed: int = 0) -> EPModel:
    """``EPModel`` with experts over ``mesh["ep"]``; the experts' weights sharded by ``data_parallel`` over
    ``mesh["dp"]`` (the ranks that hold the same experts), everything else over ``world_mesh``.

    Expert gradients: the ``dp`` ranks' sum divided by the world size, as the dense weights' are: each expert's
    local gradient already sums the tokens of every ``ep`` rank (the backward all-to-all brought them)."""
    import fsdp_passes

    ep = mesh["ep"]
    model = EPModel(n_layers, ep.get_group(), ep.get_local_rank(), ep.size(), seed)
    world = world_mesh.size()
    for layer in model.layers:
        fsdp_passes.data_parallel(layer.experts, mesh["dp"], gradient_divide_factor=float(world))
    return fsdp_passes.data_parallel(model, world_mesh)


def inputs(n_ranks: int, steps: int, batch: int = 2, seq: int = 8,
           seed: int = 5) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, every rank's (input, target) batch ``[batch, seq, DIM]``."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(batch, seq, DIM, generator=g), torch.randn(batch, seq, DIM, generator=g))
             for _ in range(n_ranks)] for _ in range(steps)]


def per_block_plan(n_layers: int) -> list:
    return [f"layers.[0-{n_layers - 1}]", "head"]

