"""Capture what Inductor's passes see, without generating or compiling code.

Two capture points, both reached through ``torch.compile`` with a backend that calls ``compile_fx`` with
our own ``inner_compile``:

* post-grad FX graphs: a recording pass is put in ``config.post_grad_custom_post_pass`` (in front of
  whatever pass is installed there); it copies the graph, runs the installed pass(es), copies again and
  stops the compile;
* scheduler nodes: ``reorder_for_compute_comm_overlap`` is switched on and the pass list becomes
  ``[record "before", *installed passes, record "after" and stop]`` (the post-grad graph is recorded too,
  without stopping there).

Stopping is a private exception.  ``inner_compile`` recognises it (also when Inductor wraps it in an
``InductorError``) and returns a function that runs the graph it was given, un-compiled, so that the
forward's outputs are real and autograd goes on to compile (and capture) the backward graph.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

__all__ = [
    "CapturedGraphs",
    "SchedulerCapture",
    "capture_fx_graphs",
    "capture_scheduler_nodes",
]


class _StopCompile(Exception):
    """Raised by a capture pass once it has what it needs; never escapes this module."""


@dataclasses.dataclass
class CapturedGraphs:
    """Post-grad FX graphs of one compiled function.

    ``forward`` / ``backward`` are copies of the graphs exactly as a ``post_grad_custom_post_pass`` receives
    them (``backward`` is None when no backward ran).  ``forward_after`` / ``backward_after`` are the same
    graphs after the ``post_grad_custom_post_pass`` installed at capture time ran (equal in content to the
    first when none is installed).  ``graphs`` lists every captured graph as ``(name, before, after)`` in
    compile order; names are ``"forward"``, ``"backward"``, ``"inference"``, suffixed ``_1``, ``_2``...
    when a function compiles to several graphs.
    """

    forward: Optional[fx.GraphModule]
    backward: Optional[fx.GraphModule]
    forward_after: Optional[fx.GraphModule]
    backward_after: Optional[fx.GraphModule]
    graphs: list[tuple[str, fx.GraphModule, fx.GraphModule]]
    output: Any = None


@dataclasses.dataclass
class SchedulerCapture:
    """The scheduler node list of one compiled graph, around ``reorder_for_compute_comm_overlap_passes``.

    ``before``: as the first pass of that list receives it.  ``after``: as returned by the last pass, i.e.
    the order Inductor would generate code in.  Nodes are live ``BaseSchedulerNode`` objects.
    """

    graph_name: str
    before: list[Any]
    after: list[Any]
    graph_lowering: Any = None
    #: the post-grad FX graph as ``post_grad_custom_post_pass`` received it (before the installed FX pass ran;
    #: ``graph_lowering.module`` is the graph Inductor lowered, after it)
    fx_before: Optional[fx.GraphModule] = None

    def graph_context(self) -> Any:
        """A context in which the nodes' sizes resolve as during the compile (re-enters Inductor's graph)."""
        from torch._inductor.virtualized import V

        if self.graph_lowering is None:
            return contextlib.nullcontext()
        return V.set_graph_handler(self.graph_lowering)

    @property
    def before_names(self) -> list[str]:
        """``get_name()`` of each node of ``before``."""
        return [n.get_name() for n in self.before]

    @property
    def after_names(self) -> list[str]:
        """``get_name()`` of each node of ``after``."""
        return [n.get_name() for n in self.after]


class _Session:
    """Per-capture state: which graph is being compiled, and what was recorded for it."""

    def __init__(self) -> None:
        self.current: Optional[str] = None
        self._counts: dict[str, int] = {}
        self.fx: list[tuple[str, fx.GraphModule, fx.GraphModule]] = []
        self.sched: list[SchedulerCapture] = []
        self._pending_before: Optional[list[Any]] = None

    def begin(self, kind: str) -> None:
        n = self._counts.get(kind, 0)
        self._counts[kind] = n + 1
        self.current = kind if n == 0 else f"{kind}_{n}"
        self._pending_before = None


def _current_graph_lowering() -> Any:
    from torch._inductor.virtualized import V

    graph = V.graph
    return graph if hasattr(graph, "sizevars") else None  # V.graph is a NullHandler outside a lowering


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a deep copy of ``gm.graph`` (node meta is copied shallowly, tensors shared)."""
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    new.meta.update(getattr(gm, "meta", {}))
    return new


def find_in_chain(exc: BaseException, kind: type[BaseException]) -> Optional[BaseException]:
    """The first exception of type ``kind`` in ``exc``'s chain (Inductor wraps errors: ``InductorError
    .inner_exception``, ``__cause__``, ``__context__``), or None."""
    seen: set[int] = set()
    todo: list[Optional[BaseException]] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        todo.extend([getattr(e, "inner_exception", None), e.__cause__, e.__context__])
    return None


def _eager_runner(gm: fx.GraphModule) -> Callable[[list[Any]], list[Any]]:
    """A boxed callable (the calling convention AOTAutograd uses) running ``gm`` un-compiled."""

    def run(args: list[Any]) -> list[Any]:
        flat = list(args)
        args.clear()
        out = gm(*flat)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _make_backend(session: _Session) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        kind = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        session.begin(kind)
        fallback = _copy_graph_module(gm)
        try:
            return compile_fx_inner(gm, example_inputs, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised unless it is our stop signal
            if find_in_chain(e, _StopCompile) is None:
                raise
        return _eager_runner(fallback)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    return backend


class _RecordPostGrad:
    """A ``post_grad_custom_post_pass`` that records the graph, runs the installed passes, records, stops."""

    def __init__(self, session: _Session, installed: Any, stop: bool = True) -> None:
        from torch._inductor.custom_graph_pass import get_custom_graph_passes

        self.session = session
        self.installed = get_custom_graph_passes(installed)
        self.stop = stop  # False: record and let the compile go on (to the scheduler capture)

    def __call__(self, graph: fx.Graph, *args: Any, **kwargs: Any) -> None:
        from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass

        gm = graph.owning_module
        before = _copy_graph_module(gm)
        for p in self.installed:
            if isinstance(p, CustomInferenceAwareGraphPass):
                p(graph, is_inference=self.session.current.startswith("inference"))  # type: ignore[union-attr]
            else:
                p(graph)
        gm.recompile()
        after = _copy_graph_module(gm)
        self.session.fx.append((self.session.current or "graph", before, after))
        if self.stop:
            raise _StopCompile()

    def uuid(self) -> bytes:
        return hashlib.sha256(b"fsdp_passes.capture.post_grad").digest()


@contextlib.contextmanager
def _capture_config(session: _Session, *, post_grad: bool, scheduler: bool) -> Iterator[None]:
    from torch._inductor import config as inductor_config

    patches: dict[str, Any] = {"fx_graph_cache": False, "fx_graph_remote_cache": False}
    if post_grad or scheduler:
        patches["post_grad_custom_post_pass"] = _RecordPostGrad(session, inductor_config.post_grad_custom_post_pass,
                                                                stop=post_grad)
    if scheduler:
        installed = list(inductor_config.reorder_for_compute_comm_overlap_passes or [])

        def record_before(nodes: list[Any]) -> list[Any]:
            session._pending_before = list(nodes)
            return nodes

        def record_after_and_stop(nodes: list[Any]) -> list[Any]:
            name = session.current or "graph"
            fx_before = next((before for graph, before, _ in reversed(session.fx) if graph == name), None)
            session.sched.append(
                SchedulerCapture(name, session._pending_before or [], list(nodes),
                                 graph_lowering=_current_graph_lowering(), fx_before=fx_before)
            )
            raise _StopCompile()

        patches["reorder_for_compute_comm_overlap"] = True
        patches["reorder_for_compute_comm_overlap_passes"] = [record_before, *installed, record_after_and_stop]
        patches["deterministic"] = False
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(patches))
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        yield


def _run(fn: Callable[..., Any], args: tuple, kwargs: dict, session: _Session, *, backward: Optional[bool],
         fullgraph: bool, reset: bool) -> Any:
    if reset:
        torch._dynamo.reset()
    compiled = torch.compile(fn, backend=_make_backend(session), fullgraph=fullgraph)
    out = compiled(*args, **kwargs)
    needs_grad = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if backward is None:
        backward = bool(needs_grad)
    if backward:
        if not needs_grad:
            raise ValueError("capture: backward=True but no output of fn requires grad")
        loss = functools.reduce(lambda a, b: a + b, [t.float().sum() for t in needs_grad])
        loss.backward()
    return out


def capture_fx_graphs(
    fn: Callable[..., Any],
    *args: Any,
    backward: Optional[bool] = None,
    fullgraph: bool = True,
    reset_dynamo: bool = True,
    **kwargs: Any,
) -> CapturedGraphs:
    """Compile ``fn(*args, **kwargs)`` and return its post-grad forward / backward FX graphs.

    The compile stops right after ``post_grad_custom_post_pass`` (no lowering, no code generation); the
    graphs are then run un-compiled.  ``backward``: run ``sum(outputs).backward()`` (None: when an output
    requires grad).  ``reset_dynamo`` calls ``torch._dynamo.reset()`` first so ``fn`` is traced afresh.
    """
    session = _Session()
    with _capture_config(session, post_grad=True, scheduler=False):
        out = _run(fn, args, kwargs, session, backward=backward, fullgraph=fullgraph, reset=reset_dynamo)

    def first(kind: str, idx: int) -> Optional[fx.GraphModule]:
        for name, before, after in session.fx:
            if name == kind:
                return (before, after)[idx]
        return None

    fwd_kind = "forward" if any(n == "forward" for n, _, _ in session.fx) else "inference"
    return CapturedGraphs(
        forward=first(fwd_kind, 0),
        backward=first("backward", 0),
        forward_after=first(fwd_kind, 1),
        backward_after=first("backward", 1),
        graphs=list(session.fx),
        output=out,
    )


def capture_scheduler_nodes(
    fn: Callable[..., Any],
    *args: Any,
    backward: Optional[bool] = None,
    fullgraph: bool = True,
    reset_dynamo: bool = True,
    **kwargs: Any,
) -> list[SchedulerCapture]:
    """Compile ``fn(*args, **kwargs)`` up to the end of the comm-overlap reorder passes of each graph.

    Returns one :class:`SchedulerCapture` per compiled graph (forward, then backward), holding the post-grad
    FX graph before the installed FX pass and the
    scheduler node list before and after the passes in ``config.reorder_for_compute_comm_overlap_passes``
    (those installed when this is called; they run even if ``reorder_for_compute_comm_overlap`` is off,
    since capturing switches it on).  No code
    is generated; the graphs then run un-compiled so that the backward is reached.
    """
    session = _Session()
    with _capture_config(session, post_grad=False, scheduler=True):
        _run(fn, args, kwargs, session, backward=backward, fullgraph=fullgraph, reset=reset_dynamo)
    return list(session.sched)
