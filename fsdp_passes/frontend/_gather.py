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
#: the largest scale: ``FLOAT8_MAX / amax`` is clamped to it through the amax (an all-zero shard's amax is 0).
#: A power of two well inside float32's range, so that the scale, and dividing by it, stay finite and exact
FLOAT8_MAX_SCALE = 2.0 ** 126


class GatherShard(torch.autograd.Function):
    """Forward: cast the padded shard to ``param_dtype``, all-gather it, drop the padding rows.  With
    ``float8`` the shard is gathered as float8 instead (``_gather_float8``) and dequantised to ``param_dtype``
    (or the shard's dtype).

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
                grad_scale: float, float8: bool) -> torch.Tensor:  # type: ignore[override]
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
        if float8 and gather_group is not None:
            return _gather_float8(shard, param_dtype or shard.dtype, full_rows, gather_size, gather_group)
        x = shard if param_dtype is None or param_dtype == shard.dtype else shard.to(param_dtype)
        if gather_group is None:
            return x.view_as(x) if x is shard else x
        full = _funcol.wait_tensor(_funcol.all_gather_into_tensor(x.contiguous(), gather_size, gather_group))
        return full if full_rows == full.shape[0] else full.narrow(0, 0, full_rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        g = grad.to(ctx.reduce_dtype)
        if not ctx.reduce:  # accumulated locally, unsharded: no collective
            return (None, g) + (None,) * 13
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
                return (None, g) + (None,) * 13
            if ctx.pending_partial is not None:
                g = g + ctx.pending_partial
            g = _funcol.wait_tensor(_funcol.all_reduce(g.contiguous(), "sum", ctx.all_reduce_group))
        # float8: straight-through, the gradient of the dequantised parameter is the shard's
        return (g.to(ctx.shard_dtype),) + (None,) * 14


def _gather_float8(shard: torch.Tensor, out_dtype: torch.dtype, full_rows: int, gather_size: int,
                   gather_group: str) -> torch.Tensor:
    """All-gather ``shard`` as float8 with one scale per shard.

    Each rank scales its shard by ``FLOAT8_MAX / amax(|shard|)``, clamps, casts to ``FLOAT8_DTYPE`` and sends
    those bytes followed by its scale's 4 bytes (float32) in one ``uint8`` all-gather (gloo has no float8
    type; the bytes are the same on every backend).  Every rank then divides each rank's rows by that rank's
    scale, in float32.  Nothing but the gather is communicated: the gather depends on no other collective,
    so float8 gathers bucket like any others.

    The scale is at most ``FLOAT8_MAX_SCALE``: an all-zero shard (zero-initialised weights such as a LoRA B,
    padding-only shards) sends zeros and comes back as exact zeros.  A non-finite element (inf or NaN) makes
    the amax, hence the scale, non-finite: that rank's rows come back NaN, the same on every rank (each divides
    the same bytes by the same scale), the other ranks' rows as usual.  Only ``FLOAT8_SCALING_OPS`` are used,
    which is what lets the passes see a parameter gather (``dag/ops.py``)."""
    s = shard.to(torch.float32)
    # clamped through the amax (a ``clamp_min``, one of the scaling ops), not with a tiny floor: 448 / tiny
    # overflows to inf, and 0 * inf is NaN
    scale = FLOAT8_MAX / s.abs().amax().reshape(1).clamp(min=FLOAT8_MAX / FLOAT8_MAX_SCALE)
    q = (s * scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8_DTYPE).view(torch.uint8).reshape(-1)
    pad = -q.numel() % 4  # the scale starts at a multiple of 4 bytes in every rank's part
    payload = torch.cat([torch.constant_pad_nd(q, [0, pad]) if pad else q, scale.view(torch.uint8)])
    gathered = _funcol.wait_tensor(_funcol.all_gather_into_tensor(payload, gather_size, gather_group))
    part = payload.numel()
    scales = gathered.view(torch.float32).view(gather_size, part // 4)[:, -1:]
    values = gathered.view(gather_size, part)[:, :q.numel()].view(FLOAT8_DTYPE).to(torch.float32)
    full = (values / scales).reshape(gather_size * shard.shape[0], *shard.shape[1:]).to(out_dtype)
    return full if full_rows == full.shape[0] else full.narrow(0, 0, full_rows)


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


def _reshard_float8_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """A float8 gather recomputes everything: scale, cast, gather and dequantisation (the shard is unchanged
    between forward and backward, so backward gathers the same bytes)."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_RECOMPUTE


def _reshard_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_reshard_policy)


def _reshard_float8_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_reshard_float8_policy)


def gather_full(shard: torch.Tensor, fqn: str, reshard_after_forward: bool, args: tuple) -> torch.Tensor:
    """The full parameter from ``shard`` (``args``: ``GatherShard``'s arguments after the shard), annotated with
    the parameter FQN; with ``reshard_after_forward`` the gather is recomputed in backward instead of saved."""

    def gather(s: torch.Tensor) -> torch.Tensor:
        return GatherShard.apply(s, *args)

    with torch.fx.traceback.annotate({FSDP_PARAM_META_KEY: fqn}):
        if reshard_after_forward and torch.is_grad_enabled() and shard.requires_grad:
            from torch.utils.checkpoint import checkpoint

            context = _reshard_float8_context if args[-1] else _reshard_context  # args[-1]: the float8 flag
            return checkpoint(gather, shard, use_reentrant=False, context_fn=context)
        return gather(shard)
