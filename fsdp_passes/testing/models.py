"""SimpleFSDP-style models for tests: dim-0 parameter shards gathered in ``forward`` by functional collectives.

``simple_fsdp(module)`` replaces every parameter by this rank's dim-0 shard and makes attribute access
(``self.weight``) return the all-gathered parameter, so that ``torch.compile`` sees, per parameter,

* forward: ``[_to_copy] -> all_gather_into_tensor -> wait_tensor``;
* backward: ``reduce_scatter_tensor -> wait_tensor`` of the gradient (and, with
  ``reshard_after_forward=True``, a second gather: the gathered parameter is recomputed, not saved).

Every gather runs inside the owning module's ``forward`` (so nodes carry that module's
``nn_module_stack``) and under ``torch.fx.traceback.annotate({"fsdp_param": fqn})``, so the traced nodes
carry ``node.meta["custom"]["fsdp_param"] == fqn`` (e.g. ``"layers.0.fc1.weight"``).  See
:func:`fsdp_param_of` for reading it back.

Gradients are summed over ranks (reduce-scatter with ``"sum"``): scale the loss by ``1 / world_size``
for the data-parallel mean.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "FSDPParam",
    "FSDP_PARAM_META_KEY",
    "simple_fsdp",
    "fsdp_params",
    "fsdp_param_of",
    "MLP",
    "Llama",
    "build_mlp",
    "build_llama",
    "example_inputs",
    "hsdp",
    "TPMLP",
    "build_tp_mlp",
]

#: Key inside ``node.meta["custom"]`` naming the parameter FQN a gather / reduce-scatter belongs to.
FSDP_PARAM_META_KEY = "fsdp_param"

_MODES = ("functional", "dtensor")


@dataclass(frozen=True)
class FSDPParam:
    """One sharded parameter: where it lives and how it is split."""

    fqn: str  #: parameter FQN in the root module, e.g. ``"layers.0.fc1.weight"``
    module_fqn: str  #: owning module FQN, e.g. ``"layers.0.fc1"`` (``""`` for the root)
    name: str  #: attribute name on the owning module, e.g. ``"weight"``
    full_shape: tuple[int, ...]  #: shape of the gathered parameter
    shard_shape: tuple[int, ...]  #: shape of the stored shard (dim 0 divided by the world size)
    orig_dtype: torch.dtype  #: dtype of the stored shard
    param_dtype: Optional[torch.dtype]  #: dtype the shard is cast to before the gather (None: no cast)
    reduce_dtype: Optional[torch.dtype]  #: dtype of the gradient reduce-scatter (None: the gather dtype)
    group_name: str  #: process group name, as it appears in the collectives' arguments
    world_size: int
    #: HSDP: the replicate group's name; gradients are all-reduced over it after the reduce-scatter (None: no HSDP)
    replicate_group_name: Optional[str] = None


# --------------------------------------------------------------------------------------------------
# The gather: functional collectives, optional mixed precision, optional recompute in backward.
# --------------------------------------------------------------------------------------------------

def _ag_wait(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), group_size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


class _GatherReduceInDtype(torch.autograd.Function):
    """All-gather ``shard`` (cast to ``param_dtype``); backward reduce-scatters the gradient in ``reduce_dtype``."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, param_dtype: Optional[torch.dtype], reduce_dtype: torch.dtype,
                group_size: int, group_name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.shard_dtype = shard.dtype
        ctx.reduce_dtype = reduce_dtype
        ctx.group_size = group_size
        ctx.group_name = group_name
        x = shard if param_dtype is None else shard.to(param_dtype)
        return _ag_wait(x, group_size, group_name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        g = grad.to(ctx.reduce_dtype).contiguous()
        rs = torch.ops._c10d_functional.reduce_scatter_tensor(g, "sum", ctx.group_size, ctx.group_name)
        out = torch.ops._c10d_functional.wait_tensor(rs)
        return out.to(ctx.shard_dtype), None, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    """Identity in forward; backward all-reduces (sum) the gradient over ``group_name`` (HSDP replicas)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        out = torch.ops._c10d_functional.all_reduce(grad.contiguous(), "sum", ctx.group_name)
        return torch.ops._c10d_functional.wait_tensor(out), None


class _AllReduceForward(torch.autograd.Function):
    """Tensor parallel "g": all-reduce (sum) in forward, identity in backward (row-parallel output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:  # type: ignore[override]
        out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name)
        return torch.ops._c10d_functional.wait_tensor(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return grad, None


def _reshard_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op in (
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.wait_tensor.default,
        torch.ops.aten._to_copy.default,
    ):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _reshard_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_reshard_policy)


class _Gather:
    """Shard -> full parameter, for one parameter (not a module: it must not change FQNs)."""

    def __init__(self, info: FSDPParam, reshard_after_forward: bool, mode: str, mesh: Any) -> None:
        self.info = info
        self.reshard_after_forward = reshard_after_forward
        self.mode = mode
        self.mesh = mesh

    def _functional(self, shard: torch.Tensor) -> torch.Tensor:
        i = self.info
        if i.replicate_group_name is not None:
            shard = _AllReduceGrad.apply(shard, i.replicate_group_name)
        gather_dtype = i.param_dtype or shard.dtype
        if i.reduce_dtype is not None and i.reduce_dtype != gather_dtype:
            return _GatherReduceInDtype.apply(shard, i.param_dtype, i.reduce_dtype, i.world_size, i.group_name)
        x = shard if i.param_dtype is None else shard.to(i.param_dtype)
        return _ag_wait(x, i.world_size, i.group_name)

    def _dtensor(self, shard: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        i = self.info
        x = shard if i.param_dtype is None else shard.to(i.param_dtype)
        d = DTensor.from_local(x, self.mesh, [Shard(0)], run_check=False, shape=torch.Size(i.full_shape),
                               stride=_contiguous_stride(i.full_shape))
        return d.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        return self._functional(shard) if self.mode == "functional" else self._dtensor(shard)

    def __call__(self, shard: torch.Tensor) -> torch.Tensor:
        with torch.fx.traceback.annotate({FSDP_PARAM_META_KEY: self.info.fqn}):
            if self.reshard_after_forward and torch.is_grad_enabled() and shard.requires_grad:
                from torch.utils.checkpoint import checkpoint

                return checkpoint(self.gather, shard, use_reentrant=False, context_fn=_reshard_context)
            return self.gather(shard)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _make_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        return self._fsdp_gathers[name](self._parameters[name])

    def set_(self: nn.Module, value: Any) -> None:
        raise AttributeError(f"{name} is a SimpleFSDP-sharded parameter; assign to ._parameters[{name!r}] instead")

    return property(get, set_)


_CLASS_CACHE: dict[tuple[type, tuple[str, ...]], type] = {}


def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _CLASS_CACHE:
        attrs = {n: _make_property(n) for n in names}
        attrs["_fsdp_sharded_names"] = names
        _CLASS_CACHE[key] = type(f"SimpleFSDP{cls.__name__}", (cls,), attrs)
    return _CLASS_CACHE[key]


def simple_fsdp(
    module: nn.Module,
    *,
    group: Optional[dist.ProcessGroup] = None,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    mode: str = "functional",
    replicate_group: Optional[dist.ProcessGroup] = None,
) -> nn.Module:
    """Shard ``module``'s parameters over ``group`` (default: the world group) in place and return it.

    Each parameter becomes an ``nn.Parameter`` holding this rank's dim-0 shard (dim 0 must be divisible by
    the world size: ``ValueError`` otherwise); reading the attribute inside ``forward`` all-gathers it.

    reshard_after_forward: free the gathered parameter after forward and gather again in backward
        (selective activation checkpointing that recomputes gather, wait and casts, saves the rest).
    param_dtype: cast the shard to this dtype before the all-gather (None: no cast); floating-point
        positional inputs of ``module`` are cast to it too.
    reduce_dtype: reduce-scatter gradients in this dtype (None: the gathered parameter's dtype).
    mode: ``"functional"`` (``_c10d_functional`` ops) or ``"dtensor"`` (``DTensor.redistribute`` to
        ``Replicate`` with ``Partial`` gradient placements, like torchtitan's SimpleFSDP).
    mesh: a 1-D ``DeviceMesh`` for ``mode="dtensor"`` (default: one over ``group``'s ranks).
    replicate_group: HSDP (``mode="functional"`` only): parameters are sharded over ``group`` and replicated
        over ``replicate_group``; the reduce-scattered gradient shards are all-reduced (sum) over it.  See
        :func:`hsdp` for a 2-D mesh.
    """
    if mode not in _MODES:
        raise ValueError(f"simple_fsdp: mode={mode!r}, expected one of {_MODES}")
    if not dist.is_initialized():
        raise RuntimeError("simple_fsdp: no default process group (use fsdp_passes.testing.fake_process_group)")
    if getattr(module, "_fsdp_params", None) is not None:
        raise ValueError("simple_fsdp: module is already sharded")
    if mode == "dtensor" and reduce_dtype is not None and reduce_dtype != (param_dtype or reduce_dtype):
        raise ValueError("simple_fsdp: reduce_dtype different from param_dtype needs mode='functional'")
    if mesh is not None:
        if mode != "dtensor":
            raise ValueError("simple_fsdp: mesh= is only used with mode='dtensor'")
        if mesh.ndim != 1:
            raise ValueError("simple_fsdp: mesh must be 1-D")
        group = mesh.get_group()
    if replicate_group is not None and mode != "functional":
        raise ValueError("simple_fsdp: replicate_group= (HSDP) needs mode='functional'")
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    group_name = group.group_name
    if mode == "dtensor" and mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        ranks = dist.get_process_group_ranks(group)
        mesh = DeviceMesh.from_group(group, "cpu", mesh=torch.tensor(ranks))

    infos: dict[str, FSDPParam] = {}
    for mod_fqn, mod in list(module.named_modules()):
        names = tuple(n for n, p in mod._parameters.items() if p is not None)
        if not names:
            continue
        gathers = {}
        for name in names:
            p = mod._parameters[name]
            fqn = f"{mod_fqn}.{name}" if mod_fqn else name
            if p.dim() == 0 or p.shape[0] % world != 0:
                raise ValueError(
                    f"simple_fsdp: parameter {fqn} of shape {tuple(p.shape)}: dim 0 must be divisible by the "
                    f"world size {world} (no padding is done)"
                )
            shard = p.detach().chunk(world, dim=0)[rank].clone()
            info = FSDPParam(
                fqn=fqn, module_fqn=mod_fqn, name=name, full_shape=tuple(p.shape), shard_shape=tuple(shard.shape),
                orig_dtype=p.dtype, param_dtype=param_dtype, reduce_dtype=reduce_dtype, group_name=group_name,
                world_size=world,
                replicate_group_name=replicate_group.group_name if replicate_group is not None else None,
            )
            mod._parameters[name] = nn.Parameter(shard, requires_grad=p.requires_grad)
            gathers[name] = _Gather(info, reshard_after_forward, mode, mesh)
            infos[fqn] = info
        mod._fsdp_gathers = gathers
        mod.__class__ = _sharded_class(type(mod), names)
    module._fsdp_params = infos
    if param_dtype is not None:
        # Cast inputs inside forward (not in a hook), so that Dynamo traces it into the same frame.
        module._fsdp_input_dtype = param_dtype
        module.__class__ = _input_cast_class(type(module))
    return module


def _cast_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    dtype = self._fsdp_input_dtype

    def cast(a: Any) -> Any:
        return a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a

    return super(self._fsdp_cast_class, self).forward(*[cast(a) for a in args],
                                                      **{k: cast(v) for k, v in kwargs.items()})


def _input_cast_class(cls: type) -> type:
    key = (cls, ("<input cast>",))
    if key not in _CLASS_CACHE:
        new = type(cls.__name__ if cls.__name__.startswith("SimpleFSDP") else f"SimpleFSDP{cls.__name__}", (cls,),
                   {"forward": _cast_forward})
        new._fsdp_cast_class = new
        _CLASS_CACHE[key] = new
    return _CLASS_CACHE[key]


def fsdp_params(module: nn.Module) -> dict[str, FSDPParam]:
    """The sharded parameters of a :func:`simple_fsdp` module, by FQN (in ``named_parameters`` order)."""
    infos = getattr(module, "_fsdp_params", None)
    if infos is None:
        raise ValueError("fsdp_params: module was not converted with simple_fsdp")
    return dict(infos)


def fsdp_param_of(node: torch.fx.Node) -> Optional[str]:
    """The parameter FQN recorded on an FX node by :func:`simple_fsdp`, or None.

    Works on the Dynamo, pre-grad and post-grad (forward and backward) graphs: the annotation is
    ``node.meta["custom"]["fsdp_param"]``.
    """
    custom = node.meta.get("custom")
    if isinstance(custom, dict):
        v = custom.get(FSDP_PARAM_META_KEY)
        return v if isinstance(v, str) else None
    return None


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _seeded(seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class _BlockStack(nn.Module):
    """``layers.<i>`` blocks applied in turn to an input ``[batch, dim]``."""

    def __init__(self, dim: int, blocks: Any) -> None:
        super().__init__()
        self.dim = dim
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def example_inputs(self, batch: int = 2) -> tuple[torch.Tensor]:
        return (torch.randn(batch, self.dim),)


class MLP(_BlockStack):
    """``layers.<i>`` residual blocks ``fc2(relu(fc1(x)))``; input ``[batch, dim]``."""

    def __init__(self, n_layers: int, dim: int, hidden: int) -> None:
        super().__init__(dim, (MLPBlock(dim, hidden) for _ in range(n_layers)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(w.dtype) * w


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """A small Llama: embeddings, ``layers.<i>`` (RMSNorm, GQA attention, SwiGLU), norm, output.

    No rotary embedding (it adds no parameters and no collectives).  Input ``[batch, seq_len]`` token ids.
    """

    def __init__(self, n_layers: int, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab: int,
                 seq_len: int) -> None:
        super().__init__()
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError("Llama: dim must be divisible by n_heads and n_heads by n_kv_heads")
        self.vocab, self.seq_len = vocab, seq_len
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, n_kv_heads, ffn_dim) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def example_inputs(self, batch: int = 2) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.vocab, (batch, self.seq_len)),)


def _maybe_shard(model: nn.Module, fsdp: Union[bool, dict], kwargs: dict) -> nn.Module:
    if fsdp:
        return simple_fsdp(model, **kwargs)
    if kwargs:
        raise TypeError(f"simple_fsdp options {sorted(kwargs)} given with fsdp=False")
    return model


def build_mlp(n_layers: int = 4, dim: int = 64, *, hidden: Optional[int] = None, seed: int = 0,
              fsdp: bool = True, **fsdp_options: Any) -> MLP:
    """A :class:`MLP` (same weights on every rank for a given ``seed``), sharded by :func:`simple_fsdp`.

    ``fsdp=False`` returns the unsharded model (an eager reference); ``fsdp_options`` go to ``simple_fsdp``.
    """
    with _seeded(seed):
        model = MLP(n_layers, dim, hidden or 2 * dim)
    return _maybe_shard(model, fsdp, fsdp_options)


def build_llama(n_layers: int = 2, dim: int = 64, n_heads: int = 4, n_kv_heads: int = 2, ffn_dim: int = 128,
                vocab: int = 128, seq_len: int = 16, *, seed: int = 0, fsdp: bool = True,
                **fsdp_options: Any) -> Llama:
    """A :class:`Llama` (same weights on every rank for a given ``seed``), sharded by :func:`simple_fsdp`."""
    with _seeded(seed):
        model = Llama(n_layers, dim, n_heads, n_kv_heads, ffn_dim, vocab, seq_len)
    return _maybe_shard(model, fsdp, fsdp_options)


def example_inputs(model: nn.Module, batch: int = 2, *, seed: Optional[int] = None) -> tuple[torch.Tensor, ...]:
    """Inputs for a model built by :func:`build_mlp` / :func:`build_llama` (seeded if ``seed`` is given)."""
    if not hasattr(model, "example_inputs"):
        raise TypeError(f"example_inputs: {type(model).__name__} is not a model from fsdp_passes.testing")
    if seed is None:
        return model.example_inputs(batch)
    with _seeded(seed):
        return model.example_inputs(batch)


# --------------------------------------------------------------------------------------------------
# Several process groups: HSDP (replicate x shard) and tensor parallel + FSDP
# --------------------------------------------------------------------------------------------------

def hsdp(module: nn.Module, mesh: Any, **fsdp_options: Any) -> nn.Module:
    """HSDP on a 2-D ``DeviceMesh`` (dim 0: replicate, dim 1: shard): parameters sharded over the shard
    group, gradients reduce-scattered there and then all-reduced over the replicate group."""
    if mesh.ndim != 2:
        raise ValueError(f"hsdp: expected a 2-D mesh (replicate, shard), got {mesh.ndim}-D")
    return simple_fsdp(module, group=mesh.get_group(1), replicate_group=mesh.get_group(0), **fsdp_options)


class TPBlock(nn.Module):
    """Megatron-style MLP block on a tensor-parallel group: ``fc1`` column-parallel, ``fc2`` row-parallel.

    Forward: ``x + all_reduce_tp(fc2(relu(fc1(x))))``; backward: the row-parallel output's all-reduce is an
    identity, the column-parallel input's gradient is all-reduced over the TP group.  Both all-reduces are
    functional collectives on the TP group (not FSDP collectives).
    """

    def __init__(self, dim: int, hidden_local: int, tp_group_name: str) -> None:
        super().__init__()
        self.tp_group_name = tp_group_name
        self.fc1 = nn.Linear(dim, hidden_local, bias=False)
        self.fc2 = nn.Linear(hidden_local, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_in = _AllReduceGrad.apply(x, self.tp_group_name)
        partial = self.fc2(F.relu(self.fc1(x_in)))
        return x + _AllReduceForward.apply(partial, self.tp_group_name)


class TPMLP(_BlockStack):
    """``layers.<i>`` :class:`TPBlock` s; input ``[batch, dim]`` (replicated over the TP group)."""

    def __init__(self, n_layers: int, dim: int, hidden_local: int, tp_group_name: str) -> None:
        super().__init__(dim, (TPBlock(dim, hidden_local, tp_group_name) for _ in range(n_layers)))


def build_tp_mlp(n_layers: int = 2, dim: int = 64, *, hidden: Optional[int] = None, tp_group: Any,
                 dp_group: Optional[dist.ProcessGroup] = None, seed: int = 0, fsdp: bool = True,
                 **fsdp_options: Any) -> TPMLP:
    """A :class:`TPMLP` whose blocks hold this TP rank's slice of a seeded full MLP (``fc1`` rows, ``fc2``
    columns), then sharded by :func:`simple_fsdp` over ``dp_group`` (default: the world group).

    TP + FSDP on a 2-D mesh ``(dp, tp)``: ``tp_group=mesh.get_group(1), dp_group=mesh.get_group(0)``.
    """
    hidden = hidden or 2 * dim
    tp = dist.get_world_size(tp_group)
    tp_rank = dist.get_rank(tp_group)
    if hidden % tp:
        raise ValueError(f"build_tp_mlp: hidden={hidden} must be divisible by the TP size {tp}")
    with _seeded(seed):
        full = MLP(n_layers, dim, hidden)
    model = TPMLP(n_layers, dim, hidden // tp, tp_group.group_name)
    with torch.no_grad():
        for src, dst in zip(full.layers, model.layers):
            dst.fc1.weight.copy_(src.fc1.weight.chunk(tp, dim=0)[tp_rank])
            dst.fc2.weight.copy_(src.fc2.weight.chunk(tp, dim=1)[tp_rank])
    if fsdp:
        return simple_fsdp(model, group=dp_group, **fsdp_options)
    if fsdp_options:
        raise TypeError(f"simple_fsdp options {sorted(fsdp_options)} given with fsdp=False")
    return model
