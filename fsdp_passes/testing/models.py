"""Models for tests, sharded by :func:`fsdp_passes.data_parallel` (SimpleFSDP style).

``simple_fsdp(module)`` is ``data_parallel`` over one process group with gradients summed over ranks: every
parameter becomes a ``DTensor`` (``Shard(0)``) whose padded local shard attribute access (``self.weight``)
all-gathers, so that ``torch.compile`` sees, per parameter,

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
    "SequenceParallelLM",
    "build_sequence_parallel_lm",
    "sequence_parallel_plan",
    "sequence_parallel_lm_stage",
    "llama_tensor_parallel_plan",
]

from ..frontend import FSDP_PARAM_META_KEY, FSDPParam, MixedPrecisionPolicy, data_parallel, sharded_params


def simple_fsdp(
    module: nn.Module,
    *,
    group: Optional[dist.ProcessGroup] = None,
    reshard_after_forward: bool = True,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    reduce_scatter_group: Any = None,
    float8_all_gather: bool = False,
) -> nn.Module:
    """:func:`fsdp_passes.data_parallel` (``mode="fully_shard"``) over ``group`` (default: the world group), with
    gradients summed over ranks; returns ``module``.

    param_dtype: cast the shard to this dtype before the all-gather (None: no cast); floating-point
        positional inputs of ``module`` are cast to it too.
    reduce_dtype: reduce-scatter gradients in this dtype (None: the gathered parameter's dtype).
    float8_all_gather: gather ``nn.Linear`` weights in float8 (``data_parallel``'s option).
    """
    if not dist.is_initialized():
        raise RuntimeError("simple_fsdp: no default process group (use fsdp_passes.testing.fake_process_group)")
    return data_parallel(module, _mesh_of(group), reshard_after_forward=reshard_after_forward,
                         mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
                         reduce_scatter_group=reduce_scatter_group, gradient_divide_factor=1.0,
                         float8_all_gather=float8_all_gather)


def _mesh_of(group: Optional[dist.ProcessGroup]) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    group = group if group is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, "cpu", mesh=torch.tensor(dist.get_process_group_ranks(group)))


def fsdp_params(module: nn.Module) -> dict[str, FSDPParam]:
    """The sharded parameters of a :func:`simple_fsdp` / ``data_parallel`` module, by FQN."""
    infos = sharded_params(module)
    if not infos:
        raise ValueError("fsdp_params: module was not converted with simple_fsdp / data_parallel")
    return infos


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
        # -1 heads: under tensor parallel the projections hold this rank's heads only
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
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
    return data_parallel(module, mesh, mode="hybrid_shard", reshard_after_forward=fsdp_options.pop("reshard_after_forward", True),
                         mp_policy=MixedPrecisionPolicy(param_dtype=fsdp_options.pop("param_dtype", None),
                                                        reduce_dtype=fsdp_options.pop("reduce_dtype", None)),
                         gradient_divide_factor=1.0, **fsdp_options)


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


# --------------------------------------------------------------------------------------------------
# A language model for torch's own tensor / sequence parallelism (``parallelize_module``)
# --------------------------------------------------------------------------------------------------

class _SPFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class _SPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ffn = _SPFeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x))


class SequenceParallelLM(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``: an embedding, pre-norm feed-forward blocks
    (``norm``, ``ffn.w1``, ``ffn.w2``, biases included), a final norm and an output projection with a bias.
    Plain modules: :func:`sequence_parallel_plan` is the ``parallelize_module`` plan that makes it tensor and
    sequence parallel.

    A pipeline stage is this model with parts removed (torchtitan's way): ``embed``, ``norm`` or ``output`` set
    to ``None`` is skipped (a later stage takes the previous stage's activations, an earlier one returns them),
    and ``layers`` may hold any run of the blocks (:func:`sequence_parallel_lm_stage`)."""

    def __init__(self, vocab: int, dim: int, hidden: int, n_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_SPBlock(dim, hidden) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) if self.embed is not None else tokens
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.output(x) if self.output is not None else x


def build_sequence_parallel_lm(vocab: int = 22, dim: int = 16, hidden: int = 24, n_layers: int = 1,
                               seed: int = 0) -> SequenceParallelLM:
    """A seeded :class:`SequenceParallelLM` (every parameter, norms and biases too, perturbed from its default
    init so that none is a constant)."""
    with _seeded(seed):
        model = SequenceParallelLM(vocab, dim, hidden, n_layers)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return model


def sequence_parallel_lm_stage(model: SequenceParallelLM, stage: int, n_stages: int) -> SequenceParallelLM:
    """Pipeline stage ``stage`` of ``n_stages`` of ``model``, in place: its share of the blocks (``n_layers /
    n_stages`` consecutive ones, renumbered from 0), the embedding on the first stage only, the final norm and
    the output on the last only."""
    if not 0 <= stage < n_stages:
        raise ValueError(f"sequence_parallel_lm_stage: stage={stage}; expected 0 <= stage < n_stages={n_stages}")
    if len(model.layers) % n_stages:
        raise ValueError(f"sequence_parallel_lm_stage: n_stages={n_stages} does not divide the model's "
                         f"{len(model.layers)} layers")
    per = len(model.layers) // n_stages
    model.layers = nn.ModuleList(model.layers[stage * per:(stage + 1) * per])
    if stage > 0:
        model.embed = None
    if stage < n_stages - 1:
        model.norm = model.output = None
    return model


def sequence_parallel_plan(model: SequenceParallelLM, loss_parallel: bool = False) -> dict[str, Any]:
    """The ``parallelize_module`` plan of :class:`SequenceParallelLM` (torchtitan's layout for Llama):
    the embedding ``RowwiseParallel`` into a sequence-sharded residual stream, norms ``SequenceParallel``, each
    feed-forward's input all-gathered by ``PrepareModuleInput``, ``w1`` ``ColwiseParallel``, ``w2``
    ``RowwiseParallel`` reduce-scattered back to sequence shards, the output ``ColwiseParallel`` gathered to
    replicated logits, or with ``loss_parallel`` left as a DTensor sharded over the vocabulary (for torch's
    ``loss_parallel()`` cross entropy).  Parts a pipeline stage removed (``None``) are left out.  The sequence
    length must divide by the tensor-parallel size."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    output = (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
              if loss_parallel else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    plan: dict[str, Any] = {
        name: style for name, style in (
            ("embed", RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))),
            ("norm", SequenceParallel()),
            ("output", output),
        ) if getattr(model, name) is not None
    }
    for i in range(len(model.layers)):
        plan.update({
            f"layers.{i}.norm": SequenceParallel(),
            f"layers.{i}.ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"layers.{i}.ffn.w1": ColwiseParallel(),
            f"layers.{i}.ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def llama_tensor_parallel_plan(model: Llama) -> dict[str, Any]:
    """The ``parallelize_module`` plan of :class:`Llama` in torchtitan's Llama 3 layout (tensor and sequence
    parallel): the embedding ``RowwiseParallel`` into a sequence-sharded residual stream, the RMSNorms
    ``SequenceParallel``, attention and feed-forward inputs all-gathered by ``PrepareModuleInput``, ``wq`` /
    ``wk`` / ``wv`` and ``w1`` / ``w3`` ``ColwiseParallel``, ``wo`` and ``w2`` ``RowwiseParallel`` reduce-scattered
    back to sequence shards, the output ``ColwiseParallel`` gathered to replicated logits (no loss parallel).
    Heads, kv heads, the ffn size, the vocabulary and the sequence length must divide by the tensor-parallel
    size."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.layers)):
        block = f"layers.{i}"
        plan.update({
            f"{block}.attention_norm": SequenceParallel(),
            f"{block}.attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            **{f"{block}.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
            f"{block}.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            f"{block}.ffn_norm": SequenceParallel(),
            f"{block}.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),)),
            **{f"{block}.feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")},
            f"{block}.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan
