"""Roofline time of one compute kernel: a fixed launch overhead plus the slower of math and memory."""

from __future__ import annotations

import math
from typing import Any

from .profiles import ClusterProfile

__all__ = ["compute_ms", "normalize_dtype", "peak_tflops"]

_ALIASES = {
    "float32": "float32", "float": "float32", "fp32": "float32", "f32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16", "f16": "float16",
}


def normalize_dtype(dtype: Any) -> str | None:
    """A dtype name (``"bfloat16"``) from a ``torch.dtype``, its name, ``"torch.bfloat16"`` or a short alias.

    Returns ``None`` for ``None``.  Names of other torch dtypes (``int64``, ``float8_e4m3fn``, ...) are
    returned as they are; anything that is not a dtype raises ``ValueError``.
    """
    if dtype is None:
        return None
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch."):]
    if text in _ALIASES:
        return _ALIASES[text]
    try:
        import torch

        if isinstance(getattr(torch, text, None), torch.dtype):
            return text
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    raise ValueError(
        f"dtype={dtype!r} is not valid: expected a torch dtype or one of {', '.join(sorted(set(_ALIASES)))}"
    )


def peak_tflops(profile: ClusterProfile, dtype: Any = None) -> float:
    """Peak dense TFLOP/s for ``dtype``.

    float16 / bfloat16 use their own peaks, 8-bit floats the bfloat16 peak (a conservative stand-in);
    everything else, and ``None``, uses the float32 peak.
    """
    name = normalize_dtype(dtype)
    if name == "bfloat16" or (name is not None and name.startswith("float8")):
        return profile.tflops_bfloat16
    if name == "float16":
        return profile.tflops_float16
    return profile.tflops_float32


def compute_ms(flops: float, bytes_moved: float, dtype: Any, profile: ClusterProfile) -> float:
    """``launch overhead + max(flops / peak, bytes / memory bandwidth)`` in milliseconds, plus the profile's
    ``matmul_fixed_us`` for a kernel that does FLOPs."""
    for field, value in (("flops", flops), ("bytes_moved", bytes_moved)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{field}={value!r} is not valid: expected a non-negative finite number")
    math_ms = flops / (peak_tflops(profile, dtype) * 1e9)  # TFLOP/s = 1e12 /s -> 1e9 per ms
    mem_ms = bytes_moved / (profile.mem_bw_gbps * 1e6)  # GB/s = 1e9 B/s -> 1e6 per ms
    fixed_us = profile.kernel_launch_us + (profile.matmul_fixed_us if flops > 0 else 0.0)
    return fixed_us / 1e3 + max(math_ms, mem_ms)
