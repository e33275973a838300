"""The per-parameter collectives: padded shard -> full parameter in forward, gradient -> padded shard in backward.

Only ``_c10d_functional`` ops are used, so ``torch.compile`` traces them into the graph where the passes see
them; the same code runs eagerly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

_funcol = torch.ops._c10d_functional

#: Key inside ``node.meta["custom"]`` naming the parameter FQN a gather / reduction belongs to.
FSDP_PARAM_META_KEY = "fsdp_param"


class GatherShard(torch.autograd.Function):
    """Forward: cast the padded shard to ``param_dtype``, all-gather it, drop the padding rows.

    Backward: pad the gradient back to the gathered size, cast it to ``reduce_dtype``, scale it by
    ``grad_scale``, reduce-scatter it (sum), all-reduce it over the replica group (hybrid shard / replicate)
    and cast it to the shard's dtype.  The padding rows of the gradient are zeros before the reduction, so
    they are zero after it: the optimizer never moves them.

    Gradient accumulation without communication: with ``reduce`` false the backward issues no collective and
    returns the unsharded gradient (in ``reduce_dtype``) as the gradient of ``sink``, a leaf whose ``.grad``
    autograd accumulates across backwards.  With ``all_reduce`` false (and a replica group) the reduce-scattered
    shard goes to ``sink`` instead of the all-reduce.  A later reducing backward adds what was accumulated
    (``pending_unsharded`` before the reduce-scatter, ``pending_partial`` before the all-reduce), so each
    collective is issued once, on the sum.
    """

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, sink: Optional[torch.Tensor], pending_unsharded: Optional[torch.Tensor],
                pending_partial: Optional[torch.Tensor], reduce: bool, all_reduce: bool,
                param_dtype: Optional[torch.dtype], reduce_dtype: torch.dtype, full_rows: int, gather_size: int,
                gather_group: Optional[str], reduce_scatter_group: Optional[str], all_reduce_group: Optional[str],
                grad_scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.shard_dtype = shard.dtype
        ctx.reduce_dtype = reduce_dtype
        ctx.gather_size = gather_size
        ctx.reduce_scatter_group = reduce_scatter_group
        ctx.all_reduce_group = all_reduce_group
        ctx.grad_scale = grad_scale
        ctx.reduce = reduce
        ctx.all_reduce = all_reduce
        ctx.padded_rows = shard.shape[0] * gather_size if shard.dim() else 0
        # not save_for_backward: under "reshard after forward" unpacking saved tensors re-runs the checkpointed
        # gather, an all-gather the backward does not need (these are inputs, nothing to recompute)
        ctx.pending_unsharded = pending_unsharded
        ctx.pending_partial = pending_partial
        x = shard if param_dtype is None or param_dtype == shard.dtype else shard.to(param_dtype)
        if gather_group is None:
            return x.view_as(x) if x is shard else x
        full = _funcol.wait_tensor(_funcol.all_gather_into_tensor(x.contiguous(), gather_size, gather_group))
        return full if full_rows == full.shape[0] else full.narrow(0, 0, full_rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        g = grad.to(ctx.reduce_dtype)
        if not ctx.reduce:  # accumulated locally, unsharded: no collective
            return (None, g) + (None,) * 12
        if ctx.pending_unsharded is not None:
            g = g + ctx.pending_unsharded
        if ctx.grad_scale != 1.0:
            g = g * ctx.grad_scale
        if ctx.reduce_scatter_group is not None:
            missing = ctx.padded_rows - g.shape[0]
            if missing:
                g = torch.constant_pad_nd(g, [0, 0] * (g.dim() - 1) + [0, missing])
            g = _funcol.wait_tensor(
                _funcol.reduce_scatter_tensor(g.contiguous(), "sum", ctx.gather_size, ctx.reduce_scatter_group))
        if ctx.all_reduce_group is not None:
            if not ctx.all_reduce:  # reduce-scattered, accumulated until an all-reducing backward
                return (None, g) + (None,) * 12
            if ctx.pending_partial is not None:
                g = g + ctx.pending_partial
            g = _funcol.wait_tensor(_funcol.all_reduce(g.contiguous(), "sum", ctx.all_reduce_group))
        return (g.to(ctx.shard_dtype),) + (None,) * 13


_RECOMPUTED_OPS = (
    _funcol.all_gather_into_tensor.default,
    _funcol.wait_tensor.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.view.default,
    torch.ops.aten.alias.default,
)


def _reshard_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective activation checkpointing for "reshard after forward": the gathered parameter (and the casts
    and views leading to it) is recomputed in backward, everything else is saved."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_RECOMPUTE if op in _RECOMPUTED_OPS else CheckpointPolicy.MUST_SAVE


def _reshard_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_reshard_policy)


def gather_full(shard: torch.Tensor, fqn: str, reshard_after_forward: bool, args: tuple) -> torch.Tensor:
    """The full parameter from ``shard`` (``args``: ``GatherShard``'s arguments after the shard), annotated with
    the parameter FQN; with ``reshard_after_forward`` the gather is recomputed in backward instead of saved."""

    def gather(s: torch.Tensor) -> torch.Tensor:
        return GatherShard.apply(s, *args)

    with torch.fx.traceback.annotate({FSDP_PARAM_META_KEY: fqn}):
        if reshard_after_forward and torch.is_grad_enabled() and shard.requires_grad:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(gather, shard, use_reentrant=False, context_fn=_reshard_context)
        return gather(shard)
