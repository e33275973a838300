"""fsdp_passes.testing.inflight_hazards: a collective's buffers are never written, freed or handed on between
its issue and its wait in the code Inductor generates for the passes' schedules (the race that would corrupt
values or the heap under gloo's worker threads); and the checker does find such a line when one is there."""

from __future__ import annotations

import functools

import pytest
import torch

import fsdp_passes
from fsdp_passes.testing import build_llama, build_mlp, example_inputs, fake_process_group
from fsdp_passes.testing import inflight_hazards

WAIT = "torch.ops._c10d_functional.wait_tensor.default({})"


def _codes(model: torch.nn.Module, inputs: tuple, options: dict) -> list[str]:
    """Inductor's wrapper code of one training step (forward and backward graph) with the passes."""
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(lambda *a: model(*a).float().square().mean())

    def step() -> None:
        compiled(*inputs).backward()

    with fsdp_passes.enabled(**options):
        _, codes = run_and_get_code(step)
    reports = [r for r in fsdp_passes.last_reports() if r.pass_name == "scheduler"]
    assert reports and not any(r.fallback for r in reports), [r.one_line() for r in reports]
    return codes


def _moved(order: list[str]) -> int:
    """How many waits the schedule does not put right after their collective's issue (so the test is about
    schedules that do keep collectives in flight)."""
    return sum(1 for i, line in enumerate(order) if "_c10d_functional" in line and " = " in line
               and i + 1 < len(order) and "wait_tensor" not in order[i + 1])


CASES = {
    # the fidelity benchmark's smoke MLP on two ranks, each reordering configuration
    "mlp-auto": ("mlp", dict(bucketing="auto", reorder=True, cluster="cpu-gloo")),
    "mlp-reorder-only": ("mlp", dict(bucketing="none", reorder=True, cluster="cpu-gloo")),
    "mlp-manual-tight-budget": ("mlp", dict(bucketing="manual", bucket_plan=["layers.[0-1]"], reorder=True,
                                            cluster="cpu-gloo", memory_budget="5%")),
    "llama-auto": ("llama", dict(bucketing="auto", reorder=True, cluster="h100-nvlink")),
}


@functools.cache
def _case_codes(case: str) -> tuple[str, ...]:
    """The wrapper code of one training step of ``case`` on rank 0 of a fake 2-rank group (compiled once per
    session, Dynamo reset and Inductor's caches off around it)."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    kind, options = CASES[case]
    torch._dynamo.reset()
    with fake_process_group(world_size=2, rank=0), inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        fsdp_passes.last_reports(clear=True)
        if kind == "mlp":
            model = build_mlp(n_layers=2, dim=64, hidden=128)
            inputs = (torch.randn(16, 64),)
        else:
            model = build_llama(n_layers=1)
            inputs = example_inputs(model, batch=2, seed=0)
        codes = _codes(model, inputs, options)
    torch._dynamo.reset()
    return tuple(codes)


@pytest.mark.parametrize("case", list(CASES))
def test_no_buffer_of_a_collective_touched_while_in_flight(case):
    codes = _case_codes(case)
    assert len(codes) == 2, case
    call_lines = [line.strip() for code in codes for line in code[code.index("def call("):].splitlines()]
    assert _moved(call_lines) > 0  # some collective overlaps other work: there is a window to check
    for code in codes:
        hazards = inflight_hazards(code)
        assert not hazards, "\n".join(map(str, hazards))


def test_checker_finds_a_wait_moved_past_the_readers_and_frees():
    """The reordered MLP's forward code with its first all-gather's wait moved to the end of ``call``: the
    checker names the reads of the gathered output before the wait and its free."""
    forward = _case_codes("mlp-reorder-only")[0]
    assert not inflight_hazards(forward)
    issue = next(line for line in forward.splitlines() if "all_gather_into_tensor.default(" in line)
    out = issue.split(" = ")[0].strip()
    wait = WAIT.format(out)
    assert wait in forward
    lines = forward.splitlines()
    moved = [line for line in lines if line.strip() != wait]
    ret = next(i for i, line in enumerate(moved) if line.strip().startswith("return ") and i > moved.index(issue))
    moved.insert(ret, " " * 8 + wait)
    hazards = inflight_hazards("\n".join(moved))
    whats = {h.what for h in hazards}
    assert {f"{out} read", f"{out} freed"} <= whats, whats
    assert all(h.collective == out for h in hazards)


SNIPPET = """
cpp_fused_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''...''')
def call(self, args):
    primals_1, primals_2 = args
    buf0 = empty_strided_cpu((8, ), (1, ), torch.float32)
    cpp_fused_0(primals_1, buf0)
    buf1 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf0, 2, '0')
    buf2 = reinterpret_tensor(buf0, (4, ), (1, ), 4)  # alias
    cpp_fused_0(primals_2, buf2)
    extern_kernels.mm(primals_2, primals_2, out=buf1)
    torch.ops._c10d_functional.wait_tensor.default(buf1)
    buf3 = torch.ops._c10d_functional.reduce_scatter_tensor.default(buf1, 'sum', 2, '0')
    return (buf3, )
"""


def test_checker_reads_writes_through_aliases_and_unwaited_returns():
    hazards = inflight_hazards(SNIPPET)
    assert [(h.collective, h.what) for h in hazards] == [
        ("buf1", "buf2 written"),  # an alias of the gather's input written by a kernel's non-const argument
        ("buf1", "buf1 written"),  # the gather's output written by an extern kernel
        ("buf3", "returned without a wait"),
    ]


def test_checker_reads_a_custom_op_of_a_gathered_buffer_before_its_wait():
    code = """
def call(self, args):
    primals_1, = args
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_1, 2, '0')
    assert_size_stride(buf0, (8, ), (1, ), 'all_gather')
    buf1 = torch.ops.fsdp_passes.copy_out_members.default(buf0, [4, 4], 2)
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    return (buf1, )
"""
    assert [(h.line, h.what) for h in inflight_hazards(code)] == [(6, "buf0 read")]
