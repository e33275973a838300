"""Which of a graph's process groups are gloo groups that run collectives on more than one worker thread.

Read at compile time from the group's name (the functional collectives' argument), as the process group this
process resolves it to.  A fake process group, an unknown name or another backend is none of them.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["gloo_worker_threads", "multi_threaded_gloo_groups"]


def gloo_worker_threads(group_name: str) -> int | None:
    """The worker threads of the gloo backend of process group ``group_name``; None when it is not gloo (or
    torch.distributed is not initialised, or the name is unknown)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group_name)
        backend = group._get_backend(torch.device("cpu"))
    except Exception:  # an unknown name, a group without a CPU backend (fake, nccl-only): not gloo
        return None
    if not isinstance(backend, dist.ProcessGroupGloo):
        return None
    try:
        return int(backend.options._threads)
    except Exception:  # the options are private: if they move, assume torch's default (2 threads per device)
        return 2


def multi_threaded_gloo_groups(group_names: Iterable[str]) -> dict[str, int]:
    """``{group name: worker threads}`` of the named groups that are gloo with more than one thread."""
    out = {}
    for name in sorted(set(group_names)):
        threads = gloo_worker_threads(name)
        if threads is not None and threads > 1:
            out[name] = threads
    return out
