"""``OverlapCosts``: what overlapping communication with compute costs, read by the simulator and the bounds."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["OverlapCosts"]


@dataclass(frozen=True)
class OverlapCosts:
    """What overlapping costs: host issue time per collective (ms) and compute slowdown while one runs."""

    issue_ms: float = 0.0
    compute_slowdown: float = 0.0

    def __post_init__(self) -> None:
        for name in ("issue_ms", "compute_slowdown"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"OverlapCosts.{name}={v!r} is not valid: expected a non-negative finite number")
