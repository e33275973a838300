"""Installing the passes into ``torch._inductor.config`` and restoring what was there.

The ``Installation`` keeps the user's config values from before the first ``install`` and the state the
installed passes share (graph names, report history); the history outlives ``uninstall`` so
``fsdp_passes.last_reports()`` still answers after an ``enabled`` block.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config

from ..options import Options
from ..pipeline.report import GraphReport
from .cache_key import options_key
from .bucket_copies import register as register_bucket_copies
from .param_names import ParamNamesPass
from .passes import FsdpGraphPass, FsdpSchedulerPass, PassState, RecomputePinPass
from .rank_check import RankChecker

log = logging.getLogger("fsdp_passes")

__all__ = ["active_options", "compile_caches_off", "install", "last_reports", "rank_checker", "scheduler_pass_wrapped",
           "set_compile_threads", "uninstall"]

_SLOTS = ("pre_grad_custom_pass", "joint_custom_post_pass", "post_grad_custom_post_pass",
          "reorder_for_compute_comm_overlap", "reorder_for_compute_comm_overlap_passes")


class Installation:
    """The passes as installed in this process: saved config values, the options in force, shared state."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] | None = None
        self.active: Options | None = None
        self.state = PassState()

    def install(self, options: Options) -> None:
        if self.saved is None:
            self.saved = {slot: getattr(inductor_config, slot) for slot in _SLOTS}
            self.saved["reorder_for_compute_comm_overlap_passes"] = list(self.saved["reorder_for_compute_comm_overlap_passes"])
        user_fx_pass = self.saved["post_grad_custom_post_pass"]
        register_bucket_copies()  # the buckets' copy-in and copy-out, as Inductor should lower them
        # names each parameter's collectives while Dynamo's graph still knows the parameters' sources
        inductor_config.pre_grad_custom_pass = ParamNamesPass(chained=self.saved["pre_grad_custom_pass"])
        # last on the joint graph (after the user's passes and Inductor's patterns), whatever the bucketing:
        # the collectives the backward issues must not depend on the local shapes
        user_joint = self.saved["joint_custom_post_pass"]
        user_joint = list(user_joint) if isinstance(user_joint, (list, tuple)) else [] if user_joint is None else [user_joint]
        inductor_config.joint_custom_post_pass = user_joint + [RecomputePinPass(options)]
        if options.bucketing != "none" or options.check_ranks:
            inductor_config.post_grad_custom_post_pass = FsdpGraphPass(options, chained=user_fx_pass, state=self.state)
        else:
            inductor_config.post_grad_custom_post_pass = user_fx_pass
        user_passes = list(self.saved["reorder_for_compute_comm_overlap_passes"]) if self.saved["reorder_for_compute_comm_overlap"] else []
        inductor_config.reorder_for_compute_comm_overlap = True
        inductor_config.reorder_for_compute_comm_overlap_passes = user_passes + [FsdpSchedulerPass(options, self.state)]
        if inductor_config.deterministic:
            log.warning("torch._inductor.config.deterministic is set: Inductor skips the comm-overlap passes, "
                        "so fsdp_passes reordering will not run")
        self.active = options
        log.info("fsdp_passes enabled: %s", options_key(options))

    def uninstall(self) -> None:
        if self.saved is None:
            return
        for slot, value in self.saved.items():
            setattr(inductor_config, slot, value)
        self.saved = None
        self.active = None


_INSTALLATION = Installation()


def install(options: Options) -> None:
    """Install (or re-install with new options) our passes, chaining with what the user had set."""
    _INSTALLATION.install(options)


def uninstall() -> None:
    """Restore the config slots exactly as they were before the first ``install``."""
    _INSTALLATION.uninstall()


def active_options() -> Options | None:
    return _INSTALLATION.active


def rank_checker() -> RankChecker:
    """The cross-rank check's state in this process (the check's op calls it at run time)."""
    return _INSTALLATION.state.rank_checker


def last_reports(clear: bool = False) -> list[GraphReport]:
    """Reports of the graphs compiled with the passes in this process, oldest first (at most 256 kept)."""
    return _INSTALLATION.state.history.reports(clear)


@contextlib.contextmanager
def scheduler_pass_wrapped(wrap: Callable[[FsdpSchedulerPass], Callable[[list], list]]) -> Iterator[None]:
    """For the block, the installed scheduler pass ``p`` is replaced by ``wrap(p)`` (a tool watching it)."""
    passes = [wrap(p) if isinstance(p, FsdpSchedulerPass) else p
              for p in inductor_config.reorder_for_compute_comm_overlap_passes]
    with inductor_config.patch(reorder_for_compute_comm_overlap_passes=passes):
        yield


@contextlib.contextmanager
def compile_caches_off() -> Iterator[None]:
    """No FX graph cache and no AOTAutograd cache for the block: every graph is compiled, the passes run."""
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def set_compile_threads(n: int) -> None:
    """Inductor compiles with ``n`` worker threads (1 in test ranks sharing a few cores)."""
    inductor_config.compile_threads = n
