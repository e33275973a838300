"""fsdp_passes: bucketing and overlap scheduling of FSDP collectives inside torch.compile / Inductor.

    import fsdp_passes
    model = fsdp_passes.data_parallel(model, mesh)      # SimpleFSDP: collectives traced by torch.compile
    fsdp_passes.enable(bucketing="auto", reorder=True, cluster="h100-nvlink", memory_budget="5%")
    model = torch.compile(model)
    ...
    fsdp_passes.disable()
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Sequence

__version__ = "0.1.0"

from .options import OptionError, Options  # noqa: E402
from .pipeline.report import GraphReport  # noqa: E402

if TYPE_CHECKING:
    import torch.distributed
    import torch.fx

    from .inductor.capture import SchedulerCapture
    from .inductor.scheduler_pass import BaseSchedulerNode
    from .pipeline import BucketingResult


def enable(options: Options | None = None, **kwargs: Any) -> Options:
    """Install the passes into ``torch._inductor.config`` for every later ``torch.compile``.

    Options come from ``options`` (an ``Options``) and/or keyword arguments (see ``Options``; keywords win),
    then ``FSDP_PASSES_<OPTION>`` environment variables override them.  A wrong value, an unknown keyword
    or an unknown ``FSDP_PASSES_*`` variable raises ``OptionError`` (a ``ValueError``) naming it.  Calling
    ``enable`` again replaces the options; passes already set in those config slots by the user keep running
    alongside ours.  Returns the options in force.
    """
    from .inductor.install import install

    resolved = Options.from_env(_merged_options("enable", options, kwargs))
    install(resolved)
    return resolved


def disable() -> None:
    """Remove the passes and restore the touched ``torch._inductor.config`` values exactly as they were."""
    from .inductor.install import uninstall

    uninstall()


@contextlib.contextmanager
def enabled(options: Options | None = None, **kwargs: Any) -> Iterator[Options]:
    """``enable(...)`` for the duration of a ``with`` block; the previous state is restored afterwards."""
    from .inductor.install import active_options

    previous = active_options()
    resolved = enable(options, **kwargs)
    try:
        yield resolved
    finally:
        if previous is None:
            disable()
        else:
            from .inductor.install import install

            install(previous)


#: the errors a caller may catch, by the module defining each (loaded on first use: the inductor ones import
#: ``torch._inductor``, which ``import fsdp_passes`` does not)
_ERRORS = {
    "FsdpPassError": "inductor.guard",  # a pass failed under strict=True (the cause is chained)
    "InvalidOrder": "inductor.scheduler_pass",  # a proposed order broke a dependency or a group's sequence
    "BucketOverBudget": "pipeline.budget",  # a manual plan over the memory budget, under strict=True
    "UnmatchedPlanEntry": "bucketing.manual",  # a bucket_plan entry matched nothing, under strict=True
    "RankMismatch": "inductor.rank_check",  # check_ranks: ranks compiled different collectives (would hang)
}


def __getattr__(name: str) -> Any:
    # the frontend imports torch.distributed.tensor: loaded on first use only
    if name in ("data_parallel", "MixedPrecisionPolicy"):
        from . import frontend

        return getattr(frontend, name)
    if name in _ERRORS:
        import importlib

        return getattr(importlib.import_module(f".{_ERRORS[name]}", __name__), name)
    raise AttributeError(f"module 'fsdp_passes' has no attribute {name!r}")


def is_enabled() -> bool:
    from .inductor.install import active_options

    return active_options() is not None


def last_reports(clear: bool = False) -> list[GraphReport]:
    """Reports of the graphs compiled with the passes in this process, oldest first (at most 256 kept);
    ``clear=True`` empties the history after reading it."""
    from .inductor.install import last_reports as _last_reports

    return _last_reports(clear)


def _merged_options(function: str, options: Options | None, kwargs: dict[str, Any]) -> Options:
    """``options`` (default ``Options()``) with the keyword arguments applied over it, validated.

    Every function that takes both an ``Options`` and keywords merges them this one way: keywords win.
    """
    import dataclasses
    import difflib

    if options is not None and not isinstance(options, Options):
        raise OptionError("options", f"fsdp_passes.{function}(options={options!r}): expected an fsdp_passes.Options "
                         "(or None) and/or option keywords")
    known = [f.name for f in dataclasses.fields(Options)]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise OptionError(unknown[0], f"fsdp_passes.{function}: unknown option(s) {', '.join(unknown)}{hint}; known options: "
                         f"{', '.join(known)}")
    if options is None:
        return Options(**kwargs)
    return options.replace(**kwargs) if kwargs else options


def bucket_graph(graph: torch.fx.Graph | torch.fx.GraphModule, options: Options | None = None,
                 **kwargs: Any) -> BucketingResult:
    """Run the bucketing pass on a captured post-grad FX graph (in place); returns its result and stats.

    Keyword options are applied over ``options`` (keywords win), as in ``enable``.
    """
    from .pipeline import bucket_graph as _bucket_graph

    return _bucket_graph(graph, _merged_options("bucket_graph", options, kwargs))


def verify_rank_consistency(group: torch.distributed.ProcessGroup | None = None) -> None:
    """Raise ``RuntimeError`` naming the first graph and collective where the ranks of ``group`` compiled
    different collective sequences (they would hang); see ``fsdp_passes.debug.consistency``."""
    from .debug.consistency import verify_rank_consistency as _verify

    _verify(last_reports(), group)


def calibrate_from_trace(path: Any, base: Any = None) -> Any:
    """A ``Calibration`` measured from a ``torch.profiler`` Chrome trace of a real training step: compiled
    kernels by name, collectives by op, size and group size (see ``fsdp_passes.cost_model.trace_calibration``).
    Save it (``.save(path)``) and pass the path as ``enable(calibration=...)``."""
    from .cost_model.trace_calibration import calibrate_from_trace as _calibrate

    return _calibrate(path, base)


def reorder_scheduler_nodes(nodes: Sequence[BaseSchedulerNode] | SchedulerCapture, options: Options | None = None,
                            **kwargs: Any) -> tuple[list[BaseSchedulerNode], GraphReport]:
    """Run the reordering pass on scheduler nodes; returns (new order, GraphReport).

    ``nodes`` is a node list or a ``fsdp_passes.testing.SchedulerCapture`` (its ``before`` list is used,
    inside the captured graph's context so sizes and FLOPs resolve exactly as during the compile).
    Keyword options are applied over ``options`` (keywords win), as in ``enable``.
    """
    from .inductor.scheduler_pass import reorder_scheduler_nodes as _reorder

    options = _merged_options("reorder_scheduler_nodes", options, kwargs)
    if hasattr(nodes, "graph_context") and hasattr(nodes, "before"):
        with nodes.graph_context():
            return _reorder(nodes.before, options, graph_name=nodes.graph_name)
    return _reorder(nodes, options)


__all__ = [
    "BucketOverBudget",
    "FsdpPassError",
    "GraphReport",
    "InvalidOrder",
    "MixedPrecisionPolicy",
    "OptionError",
    "Options",
    "RankMismatch",
    "UnmatchedPlanEntry",
    "bucket_graph",
    "calibrate_from_trace",
    "data_parallel",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "last_reports",
    "reorder_scheduler_nodes",
    "verify_rank_consistency",
    "__version__",
]
