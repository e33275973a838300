"""Public capture helpers: post-grad FX graphs and scheduler node lists of a compiled function.

Thin wrappers over :mod:`fsdp_passes.inductor.capture` that can switch the plugin on for the call.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Optional

from ..inductor.capture import CapturedGraphs, SchedulerCapture
from ..inductor import capture as _impl

__all__ = ["CapturedGraphs", "SchedulerCapture", "capture_fx_graphs", "capture_scheduler_nodes"]


def _plugin(options: Optional[Mapping[str, Any]]) -> Any:
    if options is None:
        return contextlib.nullcontext()
    from .. import enabled  # imported lazily: the plugin entry point lives in the package root

    return enabled(**dict(options))


def capture_fx_graphs(fn: Callable[..., Any], *args: Any, options: Optional[Mapping[str, Any]] = None,
                      **kwargs: Any) -> CapturedGraphs:
    """Compile ``fn(*args, **kwargs)`` with Inductor and return its post-grad FX graphs.

    ``.forward`` / ``.backward`` are copies of the graphs as a ``post_grad_custom_post_pass`` receives
    them; ``.forward_after`` / ``.backward_after`` after the installed ``post_grad_custom_post_pass`` ran.
    The compile stops there (no code generation), so a capture takes about a second on small models.

    options: if given, run under ``fsdp_passes.enabled(**options)``.  The keywords below go on to
    :func:`fsdp_passes.inductor.capture.capture_fx_graphs` (defaults there), every other one to ``fn``:
    backward: call ``sum(outputs).backward()`` to reach the backward graph (None, the default: if an output
    requires grad).
    fullgraph: compile with ``fullgraph=True`` (the default; a graph break raises).
    reset_dynamo: ``torch._dynamo.reset()`` before compiling (the default), so ``fn`` is traced afresh.
    """
    with _plugin(options):
        return _impl.capture_fx_graphs(fn, *args, **kwargs)


def capture_scheduler_nodes(fn: Callable[..., Any], *args: Any, options: Optional[Mapping[str, Any]] = None,
                            **kwargs: Any) -> list[SchedulerCapture]:
    """Compile ``fn(*args, **kwargs)`` and return, per compiled graph, the scheduler nodes around the
    comm-overlap passes.

    Each :class:`SchedulerCapture` has ``.graph_name`` (``"forward"``, ``"backward"``...), ``.before`` (the
    list as the first pass in ``torch._inductor.config.reorder_for_compute_comm_overlap_passes`` receives
    it) and ``.after`` (after the last one: the order Inductor would generate code in).  The passes are
    those installed at call time (with ``options``: by ``fsdp_passes.enabled(**options)``).  The compile
    stops there and the graphs run un-compiled.  Other arguments as :func:`capture_fx_graphs`.
    """
    with _plugin(options):
        return _impl.capture_scheduler_nodes(fn, *args, **kwargs)
