"""FLOP counts of aten ops from shapes alone, reusing ``torch.utils.flop_counter``'s formulas.

The formulas there are what ``FlopCounterMode`` uses (matmuls, convolutions, attention and their backward
ops), so counts agree with PyTorch's own.  They only need shapes, so arguments may be fake or meta tensors,
FX nodes (their ``meta["val"]`` is used) or any object with a ``.shape``.  Ops without a formula count 0.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
from torch.utils._pytree import tree_map

__all__ = ["aten_flops", "has_flop_formula"]

log = logging.getLogger(__name__)


def _registry() -> Mapping[Any, Any]:
    from torch.utils.flop_counter import flop_registry

    return flop_registry


# ops without a formula of their own that do the same math, with the same leading arguments, as one with a
# formula: the CPU backend's flash attention (what SDPA lowers to on CPU)
_SAME_MATH_AS = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
}


def _formula_key(key: Any) -> Any:
    name = getattr(key, "__name__", None) if isinstance(key, torch._ops.OpOverloadPacket) else None
    if name in _SAME_MATH_AS and getattr(key, "_qualified_op_name", "").startswith("aten::"):
        return getattr(torch.ops.aten, _SAME_MATH_AS[name])
    return key


def _packet(target: Any) -> Any:
    """The key the registry uses: an ``OpOverloadPacket`` (or a higher-order op) for ``target``."""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket
    if isinstance(target, str):
        # "aten.mm.default", "aten::mm", "torch.ops.aten.mm"
        text = target.replace("::", ".")
        if text.startswith("torch.ops."):
            text = text[len("torch.ops."):]
        parts = text.split(".")
        if len(parts) < 2:
            return None
        try:
            return getattr(getattr(torch.ops, parts[0]), parts[1])
        except (AttributeError, RuntimeError):
            return None
    return target


def has_flop_formula(target: Any) -> bool:
    """Whether ``target`` (op overload, packet or its name) has a FLOP formula."""
    key = _formula_key(_packet(target))
    try:
        return key is not None and key in _registry()
    except TypeError:  # unhashable target
        return False


def _value(x: Any) -> Any:
    if isinstance(x, torch.fx.Node):
        return x.meta.get("val", x.meta.get("example_value"))
    return x


class _Shaped:
    """Stand-in for a non-tensor object with ``.shape`` (raw formulas read ``.shape`` themselves)."""

    __slots__ = ("shape",)

    def __init__(self, shape: Sequence[Any]):
        self.shape = tuple(shape)


def _as_shape(x: Any) -> Any:
    x = _value(x)
    if isinstance(x, torch.Tensor):
        return x.shape
    shape = getattr(x, "shape", None)
    if shape is not None and not isinstance(x, (str, bytes)):
        return tuple(shape)
    return x


def _as_raw(x: Any) -> Any:
    x = _value(x)
    if isinstance(x, torch.Tensor) or x is None:
        return x
    shape = getattr(x, "shape", None)
    if shape is not None and not isinstance(x, (str, bytes)):
        return _Shaped(shape)
    return x


def aten_flops(target: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, out: Any = None) -> float:
    """FLOPs of ``target(*args, **kwargs) -> out``; 0.0 for ops without a formula or shapes it cannot read.

    ``target`` is an aten ``OpOverload`` / ``OpOverloadPacket`` (or its name, ``"aten.mm.default"``).
    """
    key = _formula_key(_packet(target))
    if key is None:
        return 0.0
    try:
        formula = _registry().get(key)
    except TypeError:
        return 0.0
    if formula is None:
        return 0.0
    kwargs = dict(kwargs or {})
    raw = not hasattr(formula, "__wrapped__")  # shape-wrapped formulas are functools.wraps'd
    conv = _as_raw if raw else _as_shape
    try:
        c_args, c_kwargs, c_out = tree_map(conv, (tuple(args), kwargs, out))
        flops = formula(*c_args, out_val=c_out, **c_kwargs)
        return float(int(flops))
    except Exception as exc:  # an estimate must never break a compile
        log.debug("no FLOP count for %s: %s", target, exc)
        return 0.0
