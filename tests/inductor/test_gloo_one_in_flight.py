"""A gloo process group with several worker threads gets at most one collective in flight at a time in the
compiled code (heap corruption otherwise: benchmarks/gloo_view_race.py), with one warning naming the fix; with
one worker thread the passes prefetch as before.  A real one-rank gloo group in this process: the graph's
collectives and the group's thread count are real, nothing is sent.  The count of collectives in flight is read
off the wrapper code Inductor generated, independently of the passes' own DAG."""

from __future__ import annotations

import logging
import re

import pytest

_COLLECTIVE = re.compile(r"^\s*(\w+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor|"
                         r"all_reduce)\.default\(")
_WAIT = re.compile(r"^\s*torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")


def _max_in_flight_in_code(code: str) -> int:
    in_flight: set[str] = set()
    most = 0
    for line in code.splitlines():
        m = _COLLECTIVE.match(line)
        if m:
            in_flight.add(m.group(1))
            most = max(most, len(in_flight))
            continue
        m = _WAIT.match(line)
        if m:
            in_flight.discard(m.group(1))
    return most


@pytest.fixture
def one_rank_gloo():
    import torch.distributed as dist

    from fsdp_passes.testing import set_gloo_worker_threads

    def init(threads: int) -> None:
        set_gloo_worker_threads(threads)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    yield init
    set_gloo_worker_threads(None)
    if dist.is_initialized():
        dist.destroy_process_group()


def _compile_step(caplog) -> tuple[int, list, list[str]]:
    import torch
    from torch._inductor.utils import run_and_get_code

    import fsdp_passes
    from fsdp_passes.testing import build_mlp

    model = build_mlp(n_layers=4, dim=64)
    fsdp_passes.last_reports(clear=True)
    with fsdp_passes.enabled(bucketing="none", memory_budget="100%", check_ranks=False), \
            caplog.at_level(logging.WARNING, logger="fsdp_passes"):
        compiled = torch.compile(model)
        _, codes = run_and_get_code(lambda: compiled(torch.randn(8, 64)).sum().backward())
    warnings = [r.getMessage() for r in caplog.records if "worker threads" in r.getMessage()]
    return max(_max_in_flight_in_code(c) for c in codes), fsdp_passes.last_reports(), warnings


def test_two_gloo_threads_keep_one_collective_in_flight(one_rank_gloo, fresh_inductor, caplog):
    one_rank_gloo(2)
    most, reports, warnings = _compile_step(caplog)
    assert most == 1
    scheduler = [r for r in reports if r.pass_name == "scheduler"]
    assert scheduler and all(r.extra["one_in_flight_groups"] == {"0": 2} for r in scheduler)
    assert all(r.extra["max_in_flight"] == {"0": 1} for r in scheduler)
    assert len(warnings) == 1, warnings  # once per group, not per graph
    assert "set_gloo_worker_threads(1)" in warnings[0] and "'0'" in warnings[0]


def test_one_gloo_thread_prefetches_as_before(one_rank_gloo, fresh_inductor, caplog):
    one_rank_gloo(1)
    most, reports, warnings = _compile_step(caplog)
    assert most >= 2  # the reordering prefetches: several all-gathers in flight
    assert not warnings
    assert not any("one_in_flight_groups" in r.extra for r in reports)
