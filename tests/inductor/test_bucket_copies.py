"""How Inductor lowers a bucket's copies: values as ``torch.cat``, buffers copied by extern kernels, and what a
whole compile generates with the passes against the same compile without them."""

import re

import torch
from torch._inductor import metrics
from torch._inductor.utils import run_and_get_code

import fsdp_passes
from fsdp_passes.inductor.bucket_copies import register
from fsdp_passes.testing import build_llama, example_inputs


def test_bucket_cat_equals_cat_and_copies_buffers_by_extern_kernels(fresh_inductor):
    """A matmul's result and a graph input are copied into their slices by ``copy_into_slot``; a pointwise
    value is computed straight into its slice by the one generated kernel."""
    register()

    def f(a, w, x, b):
        rows = [(a @ w).view(2, 12), x, (b * 3).view(2, 7)]
        return torch.ops.fsdp_passes.bucket_cat(rows, 1)

    args = (torch.randn(4, 5), torch.randn(5, 6), torch.randn(2, 5), torch.randn(14))
    out, codes = run_and_get_code(torch.compile(f), *args)
    a, w, x, b = args
    torch.testing.assert_close(out, torch.cat([(a @ w).view(2, 12), x, (b * 3).view(2, 7)], 1), rtol=0, atol=0)
    code = "\n".join(codes)
    assert len(re.findall(r"fsdp_passes\.copy_into_slot\.default\(", code)) == 2
    assert len(set(re.findall(r"\b(cpp_fused_\w+)\(", code))) == 1


def _generated_kernels(on: bool) -> tuple[int, int]:
    torch._dynamo.reset()
    model = build_llama(n_layers=2)
    (ids,) = example_inputs(model)
    if on:
        fsdp_passes.enable()
    try:
        metrics.reset()
        torch.compile(model, fullgraph=True)(ids).float().logsumexp(-1).mean().backward()
        kernels = metrics.generated_kernel_count
        reports = fsdp_passes.last_reports(clear=True)
    finally:
        fsdp_passes.disable()
    merged = sum(len(r.extra.get("bucketing", {}).get("collectives", [])) for r in reports if r.pass_name == "fx")
    return kernels, merged


def test_bucketing_adds_at_most_two_generated_kernels_per_merged_bucket(fake_pg, fresh_inductor):
    """The whole training step's compile (forward and backward, ``enable()`` defaults) against the same
    compile without the passes: a merged bucket's copies generate no kernel per member."""
    off, _ = _generated_kernels(on=False)
    on, merged = _generated_kernels(on=True)
    assert merged >= 4, merged
    assert on <= off + 2 * merged, (on, off, merged)
