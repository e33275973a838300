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

#: dtype of a float8 all-gather's payload, and its largest finite value (the scale maps the amax onto it)
FLOAT8_DTYPE = torch.float8_e4m3fn
FLOAT8_MAX = float(torch.finfo(FLOAT8_DTYPE).max)


def float8_scale(shard: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """The per-tensor scale of a float8 all-gather: ``FLOAT8_MAX / amax``, the amax of the whole parameter
    (the local shard's, all-reduced as a max over the gather's group), as a 0-dim float32 tensor equal on every
    rank of the group.  No gradient flows through it (the cast is straight-through)."""
    amax = shard.detach().abs().amax().to(torch.float32)
    amax = _funcol.wait_tensor(_funcol.all_reduce(amax, "max", group_name))
    # an all-zero parameter (zero-initialised weights): any finite scale gives zeros back
    return FLOAT8_MAX / amax.clamp(min=torch.finfo(torch.float32).tiny)


class GatherShard(torch.autograd.Function):
    """Forward: cast the padded shard to ``param_dtype``, all-gather it, drop the padding rows.  With a
    ``float8_scale`` (:func:`float8_scale`) the shard is instead scaled, clamped to the float8 range and cast to
    ``FLOAT8_DTYPE``; its bytes are gathered (as ``uint8``: gloo has no float8 type, and the bytes are the same
    on every backend) and the result is divided by the scale in float32, then cast to ``param_dtype`` (or the
    shard's dtype).

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
    def forward(ctx: Any, shard: torch.Tensor, float8_scale: Optional[torch.Tensor], sink: Optional[torch.Tensor], pending_unsharded: Optional[torch.Tensor],
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
        if float8_scale is not None and gather_group is not None:
            return _gather_float8(shard, float8_scale, param_dtype or shard.dtype, full_rows, gather_size,
                                  gather_group)
        x = shard if param_dtype is None or param_dtype == shard.dtype else shard.to(param_dtype)
        if gather_group is None:
            return x.view_as(x) if x is shard else x
        full = _funcol.wait_tensor(_funcol.all_gather_into_tensor(x.contiguous(), gather_size, gather_group))
        return full if full_rows == full.shape[0] else full.narrow(0, 0, full_rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        g = grad.to(ctx.reduce_dtype)
        if not ctx.reduce:  # accumulated locally, unsharded: no collective
            return (None, None, g) + (None,) * 12
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
                return (None, None, g) + (None,) * 12
            if ctx.pending_partial is not None:
                g = g + ctx.pending_partial
            g = _funcol.wait_tensor(_funcol.all_reduce(g.contiguous(), "sum", ctx.all_reduce_group))
        # float8: straight-through, the gradient of the dequantised parameter is the shard's
        return (g.to(ctx.shard_dtype),) + (None,) * 14


def _gather_float8(shard: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, full_rows: int,
                   gather_size: int, gather_group: str) -> torch.Tensor:
    q = (shard.to(torch.float32) * scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8_DTYPE)
    full = _funcol.wait_tensor(
        _funcol.all_gather_into_tensor(q.view(torch.uint8).contiguous(), gather_size, gather_group))
    full = (full.view(FLOAT8_DTYPE).to(torch.float32) / scale).to(out_dtype)
    return full if full_rows == full.shape[0] else full.narrow(0, 0, full_rows)


_RECOMPUTED_OPS = (
    _funcol.all_gather_into_tensor.default,
    _funcol.wait_tensor.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.view.default,
    torch.ops.aten.alias.default,
    # the float8 gather's scaling, clamp and dequantisation (the scale itself is computed outside, and kept)
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.clamp.default,
    torch.ops.aten.div.Tensor,
    torch.ops.aten.view.dtype,
)


def _reshard_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective activation checkpointing for "reshard after forward": the gathered parameter (and the casts
    and views leading to it) is recomputed in backward, everything else is saved."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_RECOMPUTE if op in _RECOMPUTED_OPS else CheckpointPolicy.MUST_SAVE


def _reshard_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_reshard_policy)


def gather_full(shard: torch.Tensor, fqn: str, reshard_after_forward: bool, args: tuple,
                float8_over: Optional[tuple[str, int]] = None) -> torch.Tensor:
    """The full parameter from ``shard`` (``args``: ``GatherShard``'s arguments after the shard and the float8
    scale), annotated with the parameter FQN; with ``reshard_after_forward`` the gather is recomputed in
    backward instead of saved.  ``float8_over``: (gather group name, group size) for a float8 all-gather; its
    scale is computed before the checkpointed region, so backward reuses it instead of all-reducing again."""

    def gather(s: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        return GatherShard.apply(s, scale, *args)

    with torch.fx.traceback.annotate({FSDP_PARAM_META_KEY: fqn}):
        scale = float8_scale(shard, *float8_over) if float8_over is not None else None
        if reshard_after_forward and torch.is_grad_enabled() and shard.requires_grad:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(gather, shard, scale, use_reentrant=False, context_fn=_reshard_context)
        return gather(shard, scale)
