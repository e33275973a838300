"""``data_parallel``: SimpleFSDP-style sharding whose collectives ``torch.compile`` traces into the graph.

Each parameter of the wrapped modules becomes an ``nn.Parameter`` holding a ``DTensor`` (``Shard(0)``;
``(Replicate(), Shard(0))`` for hybrid shard; ``Replicate()`` for replicate) with the parameter's real shape:
that is what ``named_parameters``, optimizers, ``state_dict`` and ``torch.distributed.checkpoint`` see.  Its
local tensor is a view into a *padded shard*: every rank stores ``ceil(rows / world)`` rows, the rows past the
parameter's end are zeros.  ``forward`` reads the attribute (``self.weight``) through a property that
all-gathers the padded shard and drops the padding, so every rank traces the same graph (equal shard shapes),
whatever the parameter's size.  The gradient is reduce-scattered back into a padded shard by autograd; its
padding rows are zero, and a hook hands the real rows to ``param.grad``.

Tensor parallel first (``parallelize_module(model, mesh["tp"], plan)``, then ``data_parallel(model,
mesh["dp"])``): the padded shard is taken from the tensor-parallel local tensor, the gather runs over dp only and
hands the module that local tensor as a DTensor on the tp mesh (what the plan's hooks and DTensor ops expect);
the user's parameter is a DTensor on the combined (dp, tp) mesh (``_StridedShard`` on dp where tp also splits
dim 0, as FSDP2 does).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._gather import gather_full

__all__ = ["data_parallel", "DataParallelModule", "MixedPrecisionPolicy", "FSDPParam", "sharded_params", "MODES"]

MODES = ("fully_shard", "hybrid_shard", "replicate")

#: attribute set on a parameter that ``data_parallel`` replaced: the ``_ShardedParam`` that replaced it
_REPLACED_BY = "_fsdp_passes_sharded_as"


@dataclass(frozen=True)
class FSDPParam:
    """One parameter converted by :func:`data_parallel`: where it lives and how it is split (this rank's view)."""

    fqn: str  #: parameter FQN in the outermost wrapped module, e.g. ``"layers.0.fc1.weight"``
    module_fqn: str  #: owning module FQN, e.g. ``"layers.0.fc1"`` (``""`` for that module itself)
    name: str  #: attribute name on the owning module, e.g. ``"weight"``
    full_shape: tuple[int, ...]  #: the parameter's shape (what the user sees)
    #: shape the gather returns: ``full_shape``, or with tensor parallelism this rank's tensor-parallel part
    gathered_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]  #: shape of the stored padded shard (equal on every rank)
    local_rows: int  #: rows of the parameter this rank owns (the shard's other rows are padding)
    orig_dtype: torch.dtype  #: dtype of the stored shard (the optimizer's dtype)
    param_dtype: Optional[torch.dtype]  #: dtype the shard is cast to before the gather (None: no cast)
    reduce_dtype: torch.dtype  #: dtype of the gradient reduction
    group_name: Optional[str]  #: the all-gather's process group (None: replicate mode, no gather)
    world_size: int  #: ranks the parameter is sharded over (1 for replicate)
    reduce_scatter_group_name: Optional[str]  #: the gradient reduce-scatter's group (None: none)
    replicate_group_name: Optional[str]  #: the group the gradient is all-reduced over (None: none)
    reshard_after_forward: bool
    #: the all-gather carries float8 (``float8_e4m3fn``) bytes and one scale per shard (``float8_all_gather``)
    float8_all_gather: bool = False
    #: the tensor-parallel placements of the parameter (``parallelize_module``'s) on its 1-D tensor-parallel
    #: mesh; the gathered part is handed to the module as a DTensor with these.  Empty: no tensor parallelism
    tensor_parallel: tuple = ()


class _ShardedParam:
    """Runtime state of one converted parameter: the padded shard (an autograd leaf) and the user's DTensor
    parameter viewing its real rows.

    Gradient accumulation without communication (``set_requires_gradient_sync(False)``): the gathers read while
    sync is off route the unsharded gradient to ``unsharded_sink``, and those read while the replica all-reduce
    is off (hybrid shard, replicate) route the reduce-scattered one to ``partial_sink``.  A sink is a leaf of
    the gradient's shape over one element: autograd accumulates the gradients in its ``.grad`` (the
    accumulator), the sink itself costs nothing.  The first gather of the next forward that reduces takes the
    accumulators (``_taken``: a tied or twice-read parameter has several gathers, only one may add them); the
    hook of whatever receives that backward's result frees them.

    ``reduce_dtype_follows_param``: no ``mp_policy`` dtype was given, so the gradient is reduced in the
    parameter's dtype, also after ``module.to(dtype)`` (as FSDP2 does).
    """

    def __init__(self, info: FSDPParam, storage: torch.Tensor, mesh: DeviceMesh, placements: tuple,
                 grad_scale: float, reduce_dtype_follows_param: bool, tp_mesh: Optional[DeviceMesh] = None) -> None:
        self.info = info
        self.mesh = mesh  #: the parameter's mesh: the data-parallel mesh, followed by ``tp_mesh``'s dimension
        self.placements = placements
        self.tp_mesh = tp_mesh  #: the tensor-parallel mesh the gathered part lives on (None: no tensor parallel)
        self.grad_scale = grad_scale
        self.reduce_dtype_follows_param = reduce_dtype_follows_param
        self.gather_args = self._gather_args()
        self.requires_gradient_sync = True  #: reduce-scatter (and all-reduce) in backward
        self.requires_all_reduce = True  #: all-reduce over the replica group in backward
        self._taken = False  #: a forward since the last reduction took the accumulators
        self.param = nn.Parameter(self._as_dtensor(storage.detach()), requires_grad=storage.requires_grad)
        self.storage = storage
        full_shape = (info.gathered_shape[0], *storage.shape[1:]) if storage.dim() else ()
        self.unsharded_sink = self._sink(full_shape, storage.device)
        self.partial_sink = self._sink(tuple(storage.shape), storage.device)
        self.partial_sink.register_post_accumulate_grad_hook(self._partial_accumulated)
        self._watch_storage()

    def _gather_args(self) -> tuple:
        """``GatherShard``'s arguments after the accumulation ones (``sync_args``)."""
        info = self.info
        return (info.param_dtype, info.reduce_dtype, info.gathered_shape[0] if info.gathered_shape else 1, info.world_size,
                info.group_name, info.reduce_scatter_group_name, info.replicate_group_name, self.grad_scale,
                info.float8_all_gather)

    def _as_dtensor(self, padded: torch.Tensor) -> DTensor:
        local = padded.narrow(0, 0, self.info.local_rows) if self.info.group_name is not None else padded
        shape = torch.Size(self.info.full_shape)
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))

    def _watch_storage(self) -> None:
        if self.storage.requires_grad:
            self.storage.register_post_accumulate_grad_hook(self._move_grad)

    def _move_sinks(self, device: torch.device) -> None:
        """Re-create the sinks on ``device`` in ``reduce_dtype``, each with what it accumulated (converted)."""
        for name in ("unsharded_sink", "partial_sink"):
            old: torch.Tensor = getattr(self, name)
            sink = self._sink(tuple(old.shape), device)
            if old.grad is not None:
                sink.grad = old.grad.to(device=device, dtype=sink.dtype)
            setattr(self, name, sink)
        self.partial_sink.register_post_accumulate_grad_hook(self._partial_accumulated)

    def _sink(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        one = torch.zeros((), dtype=self.info.reduce_dtype, device=device)
        return one.expand(shape).requires_grad_()

    def sync_args(self) -> tuple:
        """``GatherShard``'s accumulation arguments for a gather read now: (sink, pending unsharded gradient,
        pending partial gradient, reduce, all-reduce).  Read at trace time: a compiled forward is specialised
        (and guarded) on these flags, one graph per setting."""
        if not (torch.is_grad_enabled() and self.storage.requires_grad):
            return None, None, None, True, True
        if not self.requires_gradient_sync:
            return self.unsharded_sink, None, None, False, False
        all_reduce = self.requires_all_reduce or self.info.replicate_group_name is None
        pending_unsharded = pending_partial = None
        if not self._taken:
            pending_unsharded = self.unsharded_sink.grad
            pending_partial = self.partial_sink.grad if all_reduce else None
            if pending_unsharded is not None or pending_partial is not None:
                self._taken = True
        return None if all_reduce else self.partial_sink, pending_unsharded, pending_partial, True, all_reduce

    # autograd runs these hooks also when the backward gave the leaf no gradient (it went to a sink)
    def _partial_accumulated(self, sink: torch.Tensor) -> None:
        if sink.grad is None:
            return
        # the unsharded accumulator (if any) went into this reduce-scatter
        self.unsharded_sink.grad = None
        self._taken = False

    def _move_grad(self, storage: torch.Tensor) -> None:
        if storage.grad is None:
            return
        # a fully reduced gradient: both accumulators (if any) went into it
        self.unsharded_sink.grad = self.partial_sink.grad = None
        self._taken = False
        grad, storage.grad = storage.grad, None
        with torch.no_grad():
            as_dtensor = self._as_dtensor(grad)
            if self.param.grad is None:
                self.param.grad = as_dtensor
            else:
                self.param.grad += as_dtensor

    def full(self, owner: nn.Module, name: str) -> torch.Tensor:
        """The gathered parameter, read as ``owner.<name>`` (a tied parameter has several owners)."""
        if owner._parameters[name] is not self.param:
            raise RuntimeError(
                f"data_parallel: parameter {self.info.fqn} was replaced after sharding "
                f"({type(owner).__name__}.{name}: assignment or load_state_dict(assign=True)); copy values into it "
                f"in place instead (param.copy_ / load_state_dict)"
            )
        gathered = gather_full(self.storage, self.info.fqn, self.info.reshard_after_forward,
                               self.sync_args() + self.gather_args)
        if self.tp_mesh is None:
            return gathered
        # this rank's tensor-parallel part, gathered over data parallel only: what parallelize_module's hooks and
        # DTensor ops expect (its gradient arrives as this local part, in the layout parallelize_module gave it)
        shape = torch.Size(self.info.full_shape)
        return DTensor.from_local(gathered, self.tp_mesh, self.info.tensor_parallel, run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))

    def pending_accumulators(self) -> bool:
        """Whether gradients accumulated without sync (or without the all-reduce) wait for a reducing backward."""
        return self.unsharded_sink.grad is not None or self.partial_sink.grad is not None

    def check_conversion(self, fn: Any) -> None:
        """Raise before ``module._apply(fn)`` changes anything if it would lose the pending accumulators: they
        follow the shard's device, which a meta tensor cannot hold values on, nor give values from."""
        if not self.pending_accumulators():
            return
        # an empty tensor of the shard's kind tells where ``fn`` sends the shard, without copying it
        target = fn(self.storage.detach().reshape(-1)[:0]).device
        if target != self.storage.device and "meta" in (target.type, self.storage.device.type):
            raise RuntimeError(
                f"data_parallel: parameter {self.info.fqn} holds gradients accumulated without sync "
                f"(set_requires_gradient_sync(False) / set_requires_all_reduce(False)); moving it from "
                f"{self.storage.device} to {target} would lose them (a meta tensor holds no values): run a backward "
                f"with gradient sync on first")

    def apply_to_storage(self, fn: Any) -> None:
        """Convert the padded shard with ``fn`` (``module.to(...)``, ``to_empty``), after ``nn.Module._apply``
        converted the parameter (and its ``.grad``), and re-point the parameter at the shard.

        A no-op (``fn`` returns its input) keeps the shard itself.  The pending accumulators are kept: in
        ``reduce_dtype`` (which follows the parameter's dtype only where no ``mp_policy`` dtype fixed it), on the
        shard's device."""
        detached = self.storage.detach()
        new = fn(detached)
        if new is not detached:
            self.storage = new.detach().requires_grad_(self.param.requires_grad)
            self._watch_storage()
            if new.dtype != self.info.orig_dtype:
                follows = self.reduce_dtype_follows_param and new.dtype.is_floating_point
                self.info = dataclasses.replace(self.info, orig_dtype=new.dtype,
                                                reduce_dtype=new.dtype if follows else self.info.reduce_dtype)
                self.gather_args = self._gather_args()
            if (new.device, self.info.reduce_dtype) != (self.unsharded_sink.device, self.unsharded_sink.dtype):
                self._move_sinks(new.device)
        # swap, not ``.data =``: a DTensor keeps its local tensor in a Python attribute that ``.data`` leaves
        # alone; the parameter object (held by optimizers and the module) stays the same.  Its ``.grad`` (which
        # ``nn.Module._apply`` converted) is set aside: a swap would exchange it with the new tensor's none
        grad, self.param.grad = self.param.grad, None
        torch.utils.swap_tensors(self.param, nn.Parameter(self._as_dtensor(self.storage.detach()),
                                                          requires_grad=self.param.requires_grad))
        self.param.grad = grad


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


# --------------------------------------------------------------------------------------------------
# Module classes: properties that gather, an input / output cast
# --------------------------------------------------------------------------------------------------

def _make_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        return self._fsdp_shards[name].full(self, name)

    def set_(self: nn.Module, value: Any) -> None:
        raise AttributeError(f"{name} is sharded by data_parallel; copy values into the parameter in place instead")

    return property(get, set_)


def _states_below(module: nn.Module) -> Iterable[_ShardedParam]:
    """The converted parameters' states of ``module`` and its descendants (a tied one once per owner)."""
    for mod in module.modules():
        yield from (getattr(mod, "_fsdp_shards", None) or {}).values()


def _apply_then_reshard(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
    # checked for the whole subtree before its first tensor is converted: an error leaves the module as it was
    for state in _states_below(self) if recurse else self._fsdp_shards.values():
        state.check_conversion(fn)
    super(self._fsdp_property_class, self)._apply(fn, recurse)
    for state in self._fsdp_shards.values():
        state.apply_to_storage(fn)
    return self


@functools.lru_cache(maxsize=None)
def _property_class(cls: type, names: tuple[str, ...]) -> type:
    attrs: dict[str, Any] = {n: _make_property(n) for n in names}
    attrs["_apply"] = _apply_then_reshard
    new = type(f"DataParallel{cls.__name__}", (cls,), attrs)
    new._fsdp_property_class = new
    return new


def _cast_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    in_dtype, out_dtype = self._fsdp_input_dtype, self._fsdp_output_dtype

    def cast(value: Any, dtype: Optional[torch.dtype]) -> Any:
        if dtype is None:
            return value
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)

    out = super(self._fsdp_cast_class, self).forward(*cast(args, in_dtype), **cast(kwargs, in_dtype))
    return cast(out, out_dtype)


@functools.lru_cache(maxsize=None)
def _cast_class(cls: type) -> type:
    # Inputs are cast inside forward (not in a hook), so that Dynamo traces the cast into the same frame.
    new = type(cls.__name__ if cls.__name__.startswith("DataParallel") else f"DataParallel{cls.__name__}", (cls,),
               {"forward": _cast_forward})
    new._fsdp_cast_class = new
    return new


class DataParallelModule:
    """Mixed into the class of every module passed to :func:`data_parallel`: ``fully_shard``'s gradient-sync
    switches.  The states a call converted are that module's ``_fsdp_managed`` (``recurse=False`` reaches those;
    ``recurse=True`` those of every converted module below it too)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduces the gradients (reduce-scatter, and the all-reduce of hybrid shard /
        replicate).  ``False``: gradient accumulation without communication; each parameter accumulates its
        local unsharded gradient (in ``reduce_dtype``, a full-size tensor per parameter on every rank) and the
        next backward with sync on reduces that sum together with its own gradient, then frees it."""
        for state in self._states_to_switch("set_requires_gradient_sync", "requires_gradient_sync",
                                         requires_gradient_sync, recurse):
            state.requires_gradient_sync = requires_gradient_sync
            state.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Whether backward all-reduces the gradients over the replica group (hybrid shard, replicate) while it
        reduce-scatters them: ``False`` accumulates the reduce-scattered shards (in ``reduce_dtype``) until a
        backward with it on adds them before its all-reduce.  No effect in ``fully_shard`` mode."""
        for state in self._states_to_switch("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce,
                                         recurse):
            state.requires_all_reduce = requires_all_reduce

    def _states_to_switch(self, method: str, arg: str, value: Any, recurse: Any) -> list[_ShardedParam]:
        for name, v in ((arg, value), ("recurse", recurse)):
            if not isinstance(v, bool):
                raise ValueError(f"{method}: {name}={v!r}; expected True or False")
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [state for mod in modules for state in getattr(mod, "_fsdp_managed", ())]


@functools.lru_cache(maxsize=None)
def _with_sync_switches(cls: type) -> type:
    name = cls.__name__ if cls.__name__.startswith("DataParallel") else f"DataParallel{cls.__name__}"
    return type(name, (cls, DataParallelModule), {})


# --------------------------------------------------------------------------------------------------
# data_parallel
# --------------------------------------------------------------------------------------------------

def _default_mesh(mode: str, model: nn.Module) -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError("data_parallel: mesh=None needs an initialised default process group "
                         "(torch.distributed.init_process_group)")
    if mode == "hybrid_shard":
        raise ValueError("data_parallel: mode='hybrid_shard' needs a 2-D mesh (replicate, shard); got mesh=None")
    world = dist.group.WORLD
    devices = {p.device.type for p in model.parameters()} - {"meta"}
    device_type = devices.pop() if len(devices) == 1 else "cpu"
    return DeviceMesh.from_group(world, device_type, mesh=torch.tensor(dist.get_process_group_ranks(world)))


def _separate_group(mesh: DeviceMesh, dim: int) -> dist.ProcessGroup:
    """A new process group over the ranks of ``mesh``'s dimension ``dim`` (this rank's one); every rank of the
    default group takes part in creating every such group, as ``new_group`` requires."""
    ranks = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.shape[dim]).tolist()
    mine = None
    for row in ranks:
        group = dist.new_group(ranks=row)
        if dist.get_rank() in row:
            mine = group
    assert mine is not None
    return mine


def _check_options(mode: str, mesh: Any, mp_policy: Any, reshard_after_forward: Any, reduce_scatter_group: Any,
                   gradient_divide_factor: Any, float8_all_gather: Any) -> None:
    if mode not in MODES:
        raise ValueError(f"data_parallel: mode={mode!r}; allowed: {', '.join(MODES)}")
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"data_parallel: mesh={mesh!r}; expected a DeviceMesh or None")
    want = 2 if mode == "hybrid_shard" else 1
    if mesh.ndim != want:
        hint = " (use mode='hybrid_shard' for a 2-D mesh)" if mesh.ndim == 2 else ""
        raise ValueError(f"data_parallel: mode={mode!r} needs a {want}-D mesh, got a {mesh.ndim}-D mesh{hint}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"data_parallel: mp_policy={mp_policy!r}; expected a MixedPrecisionPolicy")
    if not (reshard_after_forward is None or isinstance(reshard_after_forward, bool)):
        raise ValueError(f"data_parallel: reshard_after_forward={reshard_after_forward!r}; allowed: True, False, None "
                         f"(an int, fully_shard's resharding to a smaller group, is not supported)")
    if not (reduce_scatter_group is None or reduce_scatter_group == "separate"
            or isinstance(reduce_scatter_group, dist.ProcessGroup)):
        raise ValueError(f"data_parallel: reduce_scatter_group={reduce_scatter_group!r}; allowed: None, "
                         f"'separate', or a ProcessGroup over the same ranks as the sharding group")
    if gradient_divide_factor is not None and not (
            isinstance(gradient_divide_factor, (int, float)) and gradient_divide_factor > 0):
        raise ValueError(f"data_parallel: gradient_divide_factor={gradient_divide_factor!r}; expected None or a "
                         f"positive number")
    if not isinstance(float8_all_gather, bool):
        raise ValueError(f"data_parallel: float8_all_gather={float8_all_gather!r}; expected True or False")
    if float8_all_gather and mode == "replicate":
        raise ValueError("data_parallel: float8_all_gather=True but mode='replicate' all-gathers nothing")


def _check_fsdp2_only(model: nn.Module, mode: str, offload_policy: Any, shard_placement_fn: Any,
                      ignored: set[int]) -> None:
    """``fully_shard`` arguments accepted for what this frontend does anyway (no offload, dim-0 shards), checked
    before any parameter is converted."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:  # a subclass offloads
        what = ("CPU offload is not supported: parameters, gradients and optimizer state stay on the mesh's device"
                if isinstance(offload_policy, CPUOffloadPolicy) else "expected None or OffloadPolicy()")
        raise ValueError(f"data_parallel: offload_policy={offload_policy!r}; {what}")
    if shard_placement_fn is None:
        return
    if not callable(shard_placement_fn):
        raise ValueError(f"data_parallel: shard_placement_fn={shard_placement_fn!r}; expected None or a function "
                         f"of a parameter returning None or Shard(0)")
    if mode == "replicate":
        raise ValueError("data_parallel: shard_placement_fn is given but mode='replicate' shards nothing")
    converted = {id(state.param) for mod in model.modules()
                 for state in (getattr(mod, "_fsdp_shards", None) or {}).values()}
    for fqn, p in model.named_parameters():  # once per parameter, tied ones included
        # ignored, or sharded by an earlier call (or the original of a tied one): not placed here (a tensor-
        # parallel DTensor is: its local part is sharded on dim 0)
        if id(p) in ignored or id(p) in converted or getattr(p, _REPLACED_BY, None) is not None:
            continue
        placement = shard_placement_fn(p)
        if isinstance(placement, Shard) and placement.dim < 0:  # as fully_shard: counted from the last dim
            placement = Shard(placement.dim + p.dim())
        if placement is not None and placement != Shard(0):
            raise ValueError(f"data_parallel: shard_placement_fn returned {placement!r} for parameter {fqn}; only "
                             f"None or Shard(0) is supported (every parameter is sharded on dim 0)")


def data_parallel(
    model: nn.Module,
    mesh: Optional[DeviceMesh] = None,
    *,
    mode: str = "fully_shard",
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    reshard_after_forward: Optional[bool] = True,
    reduce_scatter_group: Union[None, str, dist.ProcessGroup] = None,
    gradient_divide_factor: Optional[float] = None,
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    offload_policy: Any = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    float8_all_gather: bool = False,
) -> nn.Module:
    """Shard ``model``'s parameters over ``mesh`` in place (data parallel) and return ``model``.

    mode: ``"fully_shard"`` (1-D mesh, ``Shard(0)``), ``"hybrid_shard"`` (2-D mesh ``(replicate, shard)``,
        placements ``(Replicate(), Shard(0))``: gathered over dim 1, gradients reduce-scattered over dim 1 and
        all-reduced over dim 0) or ``"replicate"`` (1-D mesh, ``Replicate()``: gradients all-reduced).
    mesh: the device mesh (default: a 1-D mesh over the default process group).
    mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy``: the shard is cast to ``param_dtype`` before the
        all-gather, gradients are reduced in ``reduce_dtype`` (default: the gathered dtype), floating-point
        inputs of ``model.forward`` are cast to ``param_dtype`` (``cast_forward_inputs``) and its outputs to
        ``output_dtype``.
    reshard_after_forward: free gathered parameters after forward and gather again in backward (selective
        activation checkpointing recomputes gather, wait and casts); ``False`` keeps them for backward; ``None``
        (``fully_shard``'s default) is ``True`` here, for the root call too (``fully_shard`` keeps the root's
        parameters: pass ``False`` on the root for that).  Call
        ``data_parallel`` on submodules first to give them other settings (as with ``fully_shard``); a later
        call on an ancestor leaves their parameters as they are.
    reduce_scatter_group: ``"separate"``: gradients are reduced on a new process group over the same ranks
        (created now, by every rank), so backward all-gathers and reductions do not queue behind each other;
        a ``ProcessGroup`` to reuse one (e.g. across nested calls); ``None``: the mesh's group.
    gradient_divide_factor: gradients are summed over ranks and divided by this (default: the number of
        data-parallel ranks, i.e. averaged, as ``fully_shard`` does; ``1.0`` sums).
    ignored_params: parameters left as they are (not sharded, not reduced).
    offload_policy / shard_placement_fn: ``fully_shard``'s, so that its calls carry over: ``None`` or
        ``OffloadPolicy()`` (no offload; ``CPUOffloadPolicy`` is not supported), and a function that returns
        ``None`` or ``Shard(0)`` for every parameter (other dims are not supported).
    float8_all_gather: the weights of ``nn.Linear`` modules (2-D, this call's) are all-gathered as
        ``float8_e4m3fn``: each rank scales its shard by ``448 / amax(|shard|)``, clamps, casts and sends the
        bytes with its scale; the gathered rows are dequantised (each rank's by its scale) to ``param_dtype``
        (or the parameter's dtype).  Half the bytes of a bf16 gather (plus 4 bytes per rank); gradients are
        unchanged (straight-through, reduced as without it).  Other parameters are gathered as without it.  An
        all-zero shard comes back as zeros; an inf or NaN in a shard makes that shard's rows NaN on every rank.
        Warns (``UserWarning``) when no parameter of ``model`` ends up gathered in float8.

    A parameter shared by several modules (tied embeddings) is sharded once, under its first name in
    ``named_modules`` order, and stays one ``nn.Parameter`` for all of them; each owner gathers it when it reads
    it, and the gradient contributions are summed before they reach ``param.grad``.  One converted by an
    earlier call under another module keeps that call's settings.

    ``model`` becomes a :class:`DataParallelModule`: ``set_requires_gradient_sync`` / ``set_requires_all_reduce``
    switch gradient reduction off for gradient accumulation without communication, as with ``fully_shard``.

    Tensor parallel: a parameter that is already a DTensor on a 1-D mesh (``parallelize_module(model,
    mesh["tp"], plan)`` before this call, ``mesh`` being ``mesh["dp"]``, or ``mesh["replicate", "shard"]`` for
    hybrid shard) has its tensor-parallel local tensor sharded over ``mesh``; forward gathers it over ``mesh``
    only and hands the module a DTensor on the tensor-parallel mesh with the plan's placements; the parameter
    becomes a DTensor on the combined mesh (dp placements, then the plan's; ``_StridedShard(0, split_factor=tp)``
    on dp where the plan splits dim 0 too, as ``fully_shard`` does).

    Raises ``ValueError`` naming the module and parameter for what is not supported: DTensors on a mesh of more
    than one dimension, with a placement other than ``Shard`` / ``Replicate``, or on a mesh that is not another
    named dimension of ``mesh``'s device mesh; 0-dim parameters in a sharded mode.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"data_parallel: model={type(model).__name__}; expected an nn.Module")
    model_name = type(model).__name__  # before this call's conversion renames the class
    mesh = _default_mesh(mode, model) if mesh is None else mesh
    _check_options(mode, mesh, mp_policy, reshard_after_forward, reduce_scatter_group, gradient_divide_factor,
                   float8_all_gather)
    if reshard_after_forward is None:  # fully_shard's default; which call is the root is not known here
        reshard_after_forward = True
    ignored = {id(p) for p in ignored_params or ()}
    _check_fsdp2_only(model, mode, offload_policy, shard_placement_fn, ignored)

    shard_dim = mesh.ndim - 1
    sharded = mode != "replicate"
    world = mesh.size(shard_dim) if sharded else 1
    rank = mesh.get_local_rank(shard_dim) if sharded else 0
    mesh_group = mesh.get_group(shard_dim).group_name
    if isinstance(reduce_scatter_group, dist.ProcessGroup):
        reduce_group = reduce_scatter_group.group_name
    elif reduce_scatter_group == "separate":
        reduce_group = _separate_group(mesh, shard_dim).group_name
    else:
        reduce_group = mesh_group
    placements: tuple = {"fully_shard": (Shard(0),), "hybrid_shard": (Replicate(), Shard(0)),
                         "replicate": (Replicate(),)}[mode]
    groups = {
        "fully_shard": (mesh_group, reduce_group, None),
        "hybrid_shard": (mesh_group, reduce_group, mesh.get_group(0).group_name if mesh.ndim == 2 else None),
        "replicate": (None, None, reduce_group),
    }[mode]
    divide = gradient_divide_factor if gradient_divide_factor is not None else float(mesh.size())
    param_dtype = mp_policy.param_dtype

    # another owner of a tied parameter finds its state on the parameter it still holds (``_REPLACED_BY``), or,
    # holding the converted parameter, through the owners converted so far
    converted = {id(state.param): state for state in _states_below(model)}
    named: set[int] = set()  # states named in this call: after the first owner in ``named_modules`` order
    managed: list[_ShardedParam] = []  # states created by this call
    for mod_fqn, mod in model.named_modules():
        states: dict[str, _ShardedParam] = getattr(mod, "_fsdp_shards", None) or {}
        new_names = []
        for name, p in mod._parameters.items():
            if p is None:
                continue
            fqn = f"{mod_fqn}.{name}" if mod_fqn else name
            if id(p) in ignored:
                continue
            if name in states:  # sharded by an earlier call on this module or a descendant: keep its settings
                _name_after_first_owner(states[name], fqn, mod_fqn, named)
                continue
            state = getattr(p, _REPLACED_BY, None) or converted.get(id(p))
            if state is not None:  # another owner of a tied parameter: read the same state
                _name_after_first_owner(state, fqn, mod_fqn, named)
                states[name] = state
                new_names.append(name)
                continue
            tensor_parallel = (_tensor_parallel_layout(p, fqn, mod_fqn or type(model).__name__, mesh, placements)
                               if isinstance(p, DTensor) else None)
            if sharded and p.dim() == 0:
                raise ValueError(f"data_parallel: parameter {fqn} of module {mod_fqn or type(model).__name__} is "
                                 f"0-dimensional; mode={mode!r} shards dim 0 (use mode='replicate' or "
                                 f"ignored_params)")
            states[name] = _shard(p, fqn, mod_fqn, name, world, rank, mesh, placements, groups, param_dtype,
                                  mp_policy.reduce_dtype, reshard_after_forward and sharded, 1.0 / divide,
                                  float8_all_gather and isinstance(mod, nn.Linear) and name == "weight"
                                  and p.dim() == 2, tensor_parallel)
            named.add(id(states[name]))
            managed.append(states[name])
            new_names.append(name)
        if new_names:
            for name in new_names:
                mod._parameters[name] = states[name].param
            mod._fsdp_shards = states
            if getattr(type(mod), "_fsdp_property_class", None) is type(mod):
                cls = _property_class(type(mod).__mro__[1], tuple(states))
            else:
                cls = _property_class(type(mod), tuple(states))
            mod.__class__ = cls
    if param_dtype is not None and mp_policy.cast_forward_inputs or mp_policy.output_dtype is not None:
        model._fsdp_input_dtype = param_dtype if mp_policy.cast_forward_inputs else None
        model._fsdp_output_dtype = mp_policy.output_dtype
        if getattr(type(model), "_fsdp_cast_class", None) is not type(model):
            model.__class__ = _cast_class(type(model))
    model._fsdp_managed = (*getattr(model, "_fsdp_managed", ()), *managed)
    if float8_all_gather:
        _warn_if_nothing_gathers_in_float8(model, model_name, managed)
    if not isinstance(model, DataParallelModule):
        model.__class__ = _with_sync_switches(type(model))
    return model


@dataclass(frozen=True)
class _TensorParallelLayout:
    """Where a parameter that ``parallelize_module`` made a DTensor lives once its local part is sharded over
    data parallel (FSDP2's layout, so that state dicts and checkpoints interchange with ``fully_shard``)."""

    tp_mesh: DeviceMesh  #: the parameter's own 1-D (tensor-parallel) mesh
    tp_placements: tuple  #: its placements there
    mesh: DeviceMesh  #: the data-parallel mesh's dimensions followed by ``tp_mesh``'s
    placements: tuple  #: the data-parallel placements followed by ``tp_placements``


def _tensor_parallel_layout(p: DTensor, fqn: str, module: str, dp_mesh: DeviceMesh,
                            dp_placements: tuple) -> _TensorParallelLayout:
    """The layout of ``p``, a DTensor on a 1-D tensor-parallel mesh, after data parallel over ``dp_mesh``;
    ``ValueError`` for the DTensors this frontend cannot shard further."""
    from torch.distributed.tensor.placement_types import _StridedShard

    where = f"data_parallel: parameter {fqn} of module {module} is a DTensor"
    tp_mesh = p.device_mesh
    if tp_mesh.ndim != 1:
        raise ValueError(f"{where} on a {tp_mesh.ndim}-D mesh {tp_mesh} with placements {p.placements!r}; supported: "
                         f"a DTensor on a 1-D tensor-parallel mesh (parallelize_module(model, mesh['tp'], plan))")
    (tp_placement,) = p.placements
    if not (type(tp_placement) is Shard or isinstance(tp_placement, Replicate)):
        raise ValueError(f"{where} with placement {tp_placement!r}; supported tensor-parallel placements: Shard(dim), "
                         f"Replicate()")
    try:
        mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except (RuntimeError, AssertionError, TypeError) as e:  # other root mesh, overlapping dims, unnamed dims
        raise ValueError(f"{where} on mesh {tp_mesh}, which does not combine with mesh={dp_mesh} ({e}); the data-"
                         f"parallel and tensor-parallel meshes must be distinct named dimensions of one DeviceMesh, "
                         f"e.g. mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), "
                         f"parallelize_module(model, mesh['tp'], plan), data_parallel(model, mesh['dp'])") from None
    # where tensor parallel also splits dim 0, it split first: each tp part's rows are then split over dp, which
    # DTensor's left-to-right placements write as a strided shard over the tp parts (FSDP2 and torchtitan do too)
    tp_parts = p._spec.num_shards_map[0]
    placements = tuple(_StridedShard(0, split_factor=tp_parts) if isinstance(pl, Shard) and tp_parts > 1 else pl
                       for pl in dp_placements) + (tp_placement,)
    return _TensorParallelLayout(tp_mesh, (tp_placement,), mesh, placements)


def _warn_if_nothing_gathers_in_float8(model: nn.Module, model_name: str, managed: list[_ShardedParam]) -> None:
    """``float8_all_gather=True`` reaches only ``nn.Linear`` weights: say so when no parameter of ``model``
    gathers in float8 (not this call's, nor an earlier call's below it, as when the root call of a model whose
    blocks were converted first converts only an embedding)."""
    if any(state.info.float8_all_gather for state in _states_below(model)):
        return
    converted = (f"converted {', '.join(s.info.fqn for s in managed[:4])}{', ...' if len(managed) > 4 else ''} "
                 f"({len(managed)}), no nn.Linear weight among them" if managed else "converted no parameter")
    warnings.warn(
        f"data_parallel({model_name}, float8_all_gather=True): no parameter is gathered in float8. The option "
        f"applies to the weights of the nn.Linear modules (2-D) a call converts; this call {converted}, so it "
        f"gathers as without the option", UserWarning, stacklevel=3)


def _name_after_first_owner(state: _ShardedParam, fqn: str, module_fqn: str, named: set[int]) -> None:
    """Name ``state`` after this owner if it is the first of this call to reach it (a tied parameter's later
    owners share the name: it is what the traced gather is tagged with)."""
    if id(state) not in named:
        named.add(id(state))
        state.info = _with_fqn(state.info, fqn, module_fqn)


def _with_fqn(info: FSDPParam, fqn: str, module_fqn: str) -> FSDPParam:
    return dataclasses.replace(info, fqn=fqn, module_fqn=module_fqn)


def _shard(p: nn.Parameter, fqn: str, mod_fqn: str, name: str, world: int, rank: int, mesh: DeviceMesh,
           placements: tuple, groups: tuple, param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype],
           reshard_after_forward: bool, grad_scale: float, float8_all_gather: bool,
           tensor_parallel: Optional[_TensorParallelLayout] = None) -> _ShardedParam:
    """Store ``p`` (with ``tensor_parallel``: its tensor-parallel local part) as this rank's padded dim-0 shard."""
    gather_group, rs_group, ar_group = groups
    local = p.to_local() if tensor_parallel is not None else p
    gathered_shape = tuple(local.shape)
    if gather_group is not None:
        rows_per_rank = math.ceil(gathered_shape[0] / world)
        start = min(rank * rows_per_rank, gathered_shape[0])
        local_rows = max(0, min(rows_per_rank, gathered_shape[0] - start))
        shard_shape = (rows_per_rank, *gathered_shape[1:])
        storage = torch.zeros(shard_shape, dtype=local.dtype, device=local.device)
        if local.device.type != "meta":
            storage[:local_rows].copy_(local.detach()[start:start + local_rows])
    else:
        local_rows = gathered_shape[0] if gathered_shape else 0
        shard_shape = gathered_shape
        storage = local.detach().clone()
    storage.requires_grad_(p.requires_grad)
    info = FSDPParam(
        fqn=fqn, module_fqn=mod_fqn, name=name, full_shape=tuple(p.shape), gathered_shape=gathered_shape,
        shard_shape=shard_shape, local_rows=local_rows,
        orig_dtype=p.dtype, param_dtype=param_dtype, reduce_dtype=reduce_dtype or param_dtype or p.dtype,
        group_name=gather_group, world_size=world, reduce_scatter_group_name=rs_group if gather_group else None,
        replicate_group_name=ar_group, reshard_after_forward=reshard_after_forward,
        float8_all_gather=float8_all_gather and gather_group is not None,
        tensor_parallel=tensor_parallel.tp_placements if tensor_parallel is not None else (),
    )
    follows = reduce_dtype is None and param_dtype is None
    if tensor_parallel is not None:
        state = _ShardedParam(info, storage, tensor_parallel.mesh, tensor_parallel.placements, grad_scale,
                              reduce_dtype_follows_param=follows, tp_mesh=tensor_parallel.tp_mesh)
    else:
        state = _ShardedParam(info, storage, mesh, placements, grad_scale, reduce_dtype_follows_param=follows)
    # on the parameter it replaces: a tied parameter's other owners still hold that one until a call that reaches
    # them (on an ancestor, or on one of them) gives them this state
    setattr(p, _REPLACED_BY, state)
    return state


def sharded_params(model: nn.Module) -> dict[str, FSDPParam]:
    """The parameters of ``model`` converted by :func:`data_parallel`, by FQN (in ``named_parameters`` order: a
    tied parameter once, under its first name)."""
    out: dict[str, FSDPParam] = {}
    listed: set[int] = set()
    for mod_fqn, mod in model.named_modules():
        for name, state in (getattr(mod, "_fsdp_shards", None) or {}).items():
            if id(state) in listed:
                continue
            listed.add(id(state))
            fqn = f"{mod_fqn}.{name}" if mod_fqn else name
            out[fqn] = _with_fqn(state.info, fqn, mod_fqn)
    return out
