"""Shared fixtures: a fake process group and a fresh, cache-free Inductor.

Compiled C++ kernels go to one ``TORCHINDUCTOR_CACHE_DIR`` for the whole run: ``$FSDP_PASSES_TEST_CACHE``
if set (kept between runs), else an existing ``$TORCHINDUCTOR_CACHE_DIR``, else a temporary folder
removed at the end of the session.  Spawned gloo ranks inherit it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_TMP_CACHE: str | None = None
if os.environ.get("FSDP_PASSES_TEST_CACHE"):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["FSDP_PASSES_TEST_CACHE"]
elif not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
    _TMP_CACHE = tempfile.mkdtemp(prefix="fsdp_passes_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _TMP_CACHE


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _TMP_CACHE is not None:
        shutil.rmtree(_TMP_CACHE, ignore_errors=True)


@pytest.fixture
def fake_pg():
    """The world group of a fake 8-rank process group (rank 0), destroyed after the test."""
    from fsdp_passes.testing import fake_process_group

    with fake_process_group(world_size=8, rank=0) as group:
        yield group


@pytest.fixture
def fake_pg_factory():
    """Call with ``(world_size, rank)`` to get a fake process group's world group for this test."""
    import contextlib

    from fsdp_passes.testing import fake_process_group

    with contextlib.ExitStack() as stack:
        yield lambda world_size=8, rank=0: stack.enter_context(fake_process_group(world_size, rank))


@pytest.fixture
def fresh_inductor():
    """Reset Dynamo and switch off the FX-graph and AOTAutograd caches for the test (restored after)."""
    import torch
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), functorch_config.patch(
        enable_autograd_cache=False
    ):
        yield
    torch._dynamo.reset()
