"""The objects installed into ``torch._inductor.config`` and their installation.

- ``ParamNamesPass`` (``param_names.py``) goes into ``pre_grad_custom_pass``: names each parameter's
  collectives while Dynamo's graph still knows the parameters' sources (for plans and reports).
- ``FsdpGraphPass`` (a ``CustomGraphPass``) goes into ``post_grad_custom_post_pass``: bucketing.
- ``FsdpSchedulerPass`` (a ``CustomSchedulerPass``) goes last into ``reorder_for_compute_comm_overlap_passes``
  (with ``reorder_for_compute_comm_overlap=True``): reordering.  That list runs after Inductor's
  peak-memory reordering, so nothing undoes the order it returns (``_post_fusion_custom_pass`` runs before
  ``reorder_for_peak_memory`` and would be undone).

Cache keys: each object's ``uuid()`` hashes the package version, the package's source and data files and
the options, and the scheduler pass pickles as that uuid.  The FX graph cache therefore misses whenever
any of them changes instead of serving a graph compiled with other options or silently skipping a pass.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomSchedulerPass

from .. import __version__
from ..options import Options

log = logging.getLogger("fsdp_passes")

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class FsdpPassError(RuntimeError):
    """A pass failed (raised only with ``strict=True``; otherwise a warning and the graph is left as it was)."""


@functools.lru_cache(maxsize=1)
def package_fingerprint() -> str:
    """Hash of the package version and every source and data file: changes whenever the code does."""
    h = hashlib.sha256(__version__.encode())
    for path in sorted(_PACKAGE_ROOT.rglob("*")):
        if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_PACKAGE_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _options_key(options: Options) -> str:
    import json

    return json.dumps(options.to_json(), sort_keys=True, default=str)


def _uuid(kind: str, options: Options, chained: Any = None) -> str:
    h = hashlib.sha256()
    h.update(kind.encode())
    h.update(package_fingerprint().encode())
    h.update(_options_key(options).encode())
    if chained is not None:
        chained_uuid = chained.uuid() if hasattr(chained, "uuid") else repr(chained)
        h.update(repr(chained_uuid).encode())
    return h.hexdigest()


# --- failure injection, for tests of the fallback path (fsdp_passes.testing.inject_pass_failure) --------
_INJECTED: dict[str, str] = {}


@contextlib.contextmanager
def inject_failure(pass_name: str, mode: str = "exception") -> Iterator[None]:
    """Make pass ``pass_name`` ("fx" or "scheduler") fail: mode "exception" raises inside it, "bad_order"
    (scheduler only) makes it propose an order that breaks a dependency."""
    if pass_name not in ("fx", "scheduler") or mode not in ("exception", "bad_order"):
        raise ValueError(f"inject_failure({pass_name!r}, {mode!r}): pass is 'fx' or 'scheduler', mode 'exception' or 'bad_order'")
    _INJECTED[pass_name] = mode
    try:
        yield
    finally:
        _INJECTED.pop(pass_name, None)


def injected(pass_name: str) -> str | None:
    return _INJECTED.get(pass_name)


# --- graph names shared by the two passes of one compiled graph --------------------------------------
_graph_seq = 0
_current: dict[str, str] = {}


def _compile_id() -> str:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        if cid is not None and cid.frame_id is not None:
            return f"frame{cid.frame_id}.{cid.frame_compile_id}"
    except Exception:  # the compile id is a label only
        pass
    return "frame?"


def _new_graph_name(kind: str) -> str:
    global _graph_seq
    name = f"{_graph_seq:03d}_{kind}_{_compile_id()}"
    _graph_seq += 1
    return name


def graph_name_for_fx(graph: torch.fx.Graph) -> str:
    is_bwd = any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes)
    name = _new_graph_name("bwd" if is_bwd else "fwd")
    _current["fx"] = name
    return name


def graph_name_for_scheduler() -> str:
    """The name the FX pass gave this graph, if it ran on it; a new one otherwise."""
    try:
        from torch._inductor.virtualized import V

        kind = "bwd" if getattr(V.graph, "is_backward", False) else "fwd"
    except Exception:
        kind = "fwd"
    name = _current.pop("fx", None)
    # the FX pass's name only if it was this graph's (a capture may have stopped a compile after it)
    if name is not None and name.split("_", 1)[1] == f"{kind}_{_compile_id()}":
        return name
    return _new_graph_name(kind)


def run_guarded(pass_name: str, options: Options, fn: Callable[[], Any], fallback: Callable[[], Any],
                skipped: Callable[[str], Any] | None = None) -> Any:
    """Run ``fn``; on any exception warn (naming the pass and the reason) and return ``fallback()``,
    or raise ``FsdpPassError`` when ``options.strict``.

    A graph the passes leave alone by design (``UnplannableGraph``: unbacked sizes, unsupported node kinds)
    is not a failure: one INFO line says why and ``skipped(reason)`` (default ``fallback()``) is returned,
    with or without ``strict``; no warning.
    """
    from ..dag.from_fx import UnplannableGraph

    try:
        return fn()
    except UnplannableGraph as exc:
        log.info("fsdp_passes %s pass: graph left untouched: %s", pass_name, exc)
        return skipped(str(exc)) if skipped is not None else fallback()
    except Exception as exc:
        message = f"fsdp_passes {pass_name} pass failed, graph left as it was: {type(exc).__name__}: {exc}"
        if options.strict:
            raise FsdpPassError(message) from exc
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        log.warning(message)
        return fallback()


class FsdpGraphPass(CustomGraphPass):
    """Post-grad FX pass: bucket FSDP collectives; then run the pass that was installed before ours."""

    def __init__(self, options: Options, chained: Any = None):
        self.options = options
        self.chained = chained

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        from .fx_pass import run_fx_pass

        run_fx_pass(graph, self.options, graph_name=graph_name_for_fx(graph))

    def uuid(self) -> str:
        return _uuid("fx", self.options, self.chained)


def _restore_scheduler_pass(options_json: dict, uuid: str) -> "FsdpSchedulerPass":
    return FsdpSchedulerPass(Options(**options_json))


class FsdpSchedulerPass(CustomSchedulerPass):
    """Scheduler pass: reorder for overlap, validate the order, fall back to the input order on any problem."""

    def __init__(self, options: Options):
        self.options = options

    def __call__(self, nodes: list) -> list:
        from .scheduler_pass import reorder_scheduler_nodes

        name = graph_name_for_scheduler()

        def fallback(reason: str = "pass failed; input order kept") -> list:
            from ..report import GraphReport, record

            record(GraphReport(graph=name, pass_name="scheduler", options=self.options.to_json(),
                               fallback=reason))
            return nodes

        return run_guarded(
            "scheduler",
            self.options,
            lambda: reorder_scheduler_nodes(nodes, self.options, graph_name=name)[0],
            fallback,
            lambda reason: fallback(f"left untouched: {reason}"),
        )

    def uuid(self) -> str:
        return _uuid("scheduler", self.options)

    # the FX graph cache pickles this list into its key: pickle as the uuid, never as a qualified name only
    def __reduce__(self):
        return (_restore_scheduler_pass, (self.options.to_json(), self.uuid()))


# --- installation -----------------------------------------------------------------------------------------
_SLOTS = ("pre_grad_custom_pass", "post_grad_custom_post_pass", "reorder_for_compute_comm_overlap",
          "reorder_for_compute_comm_overlap_passes")
_saved: dict[str, Any] | None = None
_active: Options | None = None


def install(options: Options) -> None:
    """Install (or re-install with new options) our passes, chaining with what the user had set."""
    global _saved, _active
    if _saved is None:
        _saved = {slot: getattr(inductor_config, slot) for slot in _SLOTS}
        _saved["reorder_for_compute_comm_overlap_passes"] = list(_saved["reorder_for_compute_comm_overlap_passes"])
    from .param_names import ParamNamesPass

    user_fx_pass = _saved["post_grad_custom_post_pass"]
    inductor_config.pre_grad_custom_pass = ParamNamesPass(chained=_saved["pre_grad_custom_pass"])
    if options.bucketing != "none":
        inductor_config.post_grad_custom_post_pass = FsdpGraphPass(options, chained=user_fx_pass)
    else:
        inductor_config.post_grad_custom_post_pass = user_fx_pass
    user_passes = list(_saved["reorder_for_compute_comm_overlap_passes"]) if _saved["reorder_for_compute_comm_overlap"] else []
    inductor_config.reorder_for_compute_comm_overlap = True
    inductor_config.reorder_for_compute_comm_overlap_passes = user_passes + [FsdpSchedulerPass(options)]
    if inductor_config.deterministic:
        log.warning("torch._inductor.config.deterministic is set: Inductor skips the comm-overlap passes, "
                    "so fsdp_passes reordering will not run")
    _active = options
    log.info("fsdp_passes enabled: %s", _options_key(options))


def uninstall() -> None:
    """Restore the config slots exactly as they were before the first ``install``."""
    global _saved, _active
    if _saved is None:
        return
    for slot, value in _saved.items():
        setattr(inductor_config, slot, value)
    _saved = None
    _active = None


def active_options() -> Options | None:
    return _active
