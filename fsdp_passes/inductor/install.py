"""Installing the passes into ``torch._inductor.config`` and restoring what was there.

The ``Installation`` keeps the user's config values from before the first ``install`` and the state the
installed passes share (graph names, report history); the history outlives ``uninstall`` so
``fsdp_passes.last_reports()`` still answers after an ``enabled`` block.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import get_custom_graph_passes

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

# Inductor's own passes that bucket or reorder collectives, each as (config name, the value that switches it
# off).  Left on, a second planner would merge our buckets or move our collectives after (FX) or around
# (scheduler) our passes.  A name missing from the installed torch is skipped, so names that only newer torch
# has can be listed here.
INDUCTOR_COMM_PLANNERS: tuple[tuple[str, Any], ...] = (
    ("bucket_all_gathers_fx", "none"),  # FX bucketing after the post-grad custom pass: merges our buckets
    ("bucket_reduce_scatters_fx", "none"),
    ("bucket_all_reduces_fx", "none"),
    ("_fuse_ddp_communication", False),  # DDP's all-reduce fusion and wait scheduling (its Python reducer sets it)
    # OverlapScheduler with its overlap-preserving bucketer and FSDP pre-bucketing
    ("aten_distributed_optimizations.enable_overlap_scheduling", False),
    ("aten_distributed_optimizations.enable_simple_overlap", False),  # not in torch 2.13; on by default later
)
# Settings of the overlap scheduler that bucket.  In torch 2.13 they act only while its switch above is on; they
# are switched off as well so that no other caller of that scheduler (a newer torch's simple-overlap path, a
# user's pass calling ``schedule_overlap_bucketing_from_inductor_configs``) buckets the graphs ours plan.  Not
# named in the warning: by themselves they run nothing.
INDUCTOR_COMM_PLANNER_SETTINGS: tuple[tuple[str, Any], ...] = (
    ("aten_distributed_optimizations.collective_bucketing", False),
    ("aten_distributed_optimizations.pre_bucketing_fsdp_collectives", False),
)


def is_inductor_comm_pass(entry: Any) -> bool:
    """Whether an entry of ``reorder_for_compute_comm_overlap_passes`` is one of Inductor's own comm-reordering
    passes: a name (Inductor looks every string up among ``torch._inductor.comms``'s functions: ``sink_waits``,
    ``raise_comms``, ``reorder_compute_for_overlap``, ``sink_waits_iterative``,
    ``reorder_communication_preserving_peak_memory``) or one of those functions passed directly."""
    if isinstance(entry, str):
        return True
    return getattr(entry, "__module__", None) == "torch._inductor.comms"


def _planner_knobs() -> list[tuple[str, Any]]:
    """The planner switches and settings the installed torch has."""
    return [(name, off) for name, off in INDUCTOR_COMM_PLANNERS + INDUCTOR_COMM_PLANNER_SETTINGS
            if hasattr(inductor_config, name)]


class Installation:
    """The passes as installed in this process: saved config values, the options in force, shared state."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] | None = None
        self.active: Options | None = None
        self.state = PassState()

    def install(self, options: Options) -> None:
        # the gloo warning is said once per group and installation: a group name comes back with a new process
        # group (destroy and init again), which deserves its own warning
        self.state.gloo_groups_warned.clear()
        if self.saved is None:
            self.saved = {slot: getattr(inductor_config, slot) for slot in _SLOTS}
            self.saved["reorder_for_compute_comm_overlap_passes"] = list(self.saved["reorder_for_compute_comm_overlap_passes"])
            self.saved.update({name: getattr(inductor_config, name) for name, _ in _planner_knobs()})
            self._warn_planners_switched_off()
        user_fx_pass = self.saved["post_grad_custom_post_pass"]
        register_bucket_copies()  # the buckets' copy-in and copy-out, as Inductor should lower them
        # names each parameter's collectives while Dynamo's graph still knows the parameters' sources
        inductor_config.pre_grad_custom_pass = ParamNamesPass(chained=self.saved["pre_grad_custom_pass"])
        # last on the joint graph (after the user's passes and Inductor's patterns), whatever the bucketing:
        # the collectives the backward issues must not depend on the local shapes
        user_joint = list(get_custom_graph_passes(self.saved["joint_custom_post_pass"]))  # None, one or a list
        inductor_config.joint_custom_post_pass = user_joint + [RecomputePinPass(options)]
        if options.bucketing != "none" or options.check_ranks:
            inductor_config.post_grad_custom_post_pass = FsdpGraphPass(options, chained=user_fx_pass, state=self.state)
        else:
            inductor_config.post_grad_custom_post_pass = user_fx_pass
        for name, off in _planner_knobs():
            setattr(inductor_config, name, off)
        # the user's own scheduler passes run before ours (they are not Inductor planners; what they do is theirs);
        # Inductor's built-in ones are dropped
        user_passes = ([p for p in self.saved["reorder_for_compute_comm_overlap_passes"] if not is_inductor_comm_pass(p)]
                       if self.saved["reorder_for_compute_comm_overlap"] else [])
        inductor_config.reorder_for_compute_comm_overlap = True
        inductor_config.reorder_for_compute_comm_overlap_passes = user_passes + [FsdpSchedulerPass(options, self.state)]
        if inductor_config.deterministic:
            log.warning("torch._inductor.config.deterministic is set: Inductor skips the comm-overlap passes, "
                        "so fsdp_passes reordering will not run")
        self.active = options
        log.info("fsdp_passes enabled: %s", options_key(options))

    def _warn_planners_switched_off(self) -> None:
        """One warning naming the Inductor comm passes the user had on and ``install`` switches off."""
        assert self.saved is not None
        was_on = [f"{name}={self.saved[name]!r}" for name, off in INDUCTOR_COMM_PLANNERS
                  if name in self.saved and self.saved[name] != off]
        if self.saved["reorder_for_compute_comm_overlap"]:
            dropped = [p if isinstance(p, str) else p.__name__
                       for p in self.saved["reorder_for_compute_comm_overlap_passes"] if is_inductor_comm_pass(p)]
            if dropped:
                was_on.append(f"reorder_for_compute_comm_overlap_passes entries {dropped}")
        if was_on:
            log.warning("fsdp_passes plans the buckets and the order of the collectives, so it switched off "
                        "Inductor's own comm passes that would bucket or reorder them again: %s "
                        "(disable() restores them)", ", ".join(was_on))

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


@torch.library.impl("fsdp_passes::check_ranks", "CompositeExplicitAutograd")
def _check_ranks(graph: str, sequences: str, timeout_s: float) -> None:
    """What ``fsdp_passes::check_ranks`` does: compare this graph's per-group collective sequences with the other
    ranks' (its first run only), with this installation's state."""
    _INSTALLATION.state.rank_checker.check(graph, sequences, timeout_s)


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
