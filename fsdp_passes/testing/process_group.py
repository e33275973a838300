"""A one-process fake process group for structural tests of distributed graphs."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

__all__ = ["fake_process_group"]


@contextlib.contextmanager
def fake_process_group(world_size: int = 8, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Initialise the default process group with the ``"fake"`` backend and yield the world group.

    Collectives on a fake group complete immediately and move no data, so graphs can be traced,
    compiled and run in one process with the shapes of a ``world_size``-rank job.  The group is
    destroyed on exit.  Raises ``RuntimeError`` if a default process group already exists, since
    replacing it would break whoever created it.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"fake_process_group: need world_size >= 1 and 0 <= rank < world_size, got "
                         f"world_size={world_size}, rank={rank}")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_process_group: a default process group is already initialised "
            f"(backend {dist.get_backend()!r}); destroy it first with dist.destroy_process_group()"
        )
    # Importing the module registers the "fake" backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
