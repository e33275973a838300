"""Dynamic shapes: backed symbolic sizes are planned with their size hints; unbacked (data-dependent) sizes
leave the graph untouched with one logged reason, never a crash and never a warning."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import fsdp_passes
from fsdp_passes.testing import build_mlp, capture_scheduler_nodes, example_inputs, fake_process_group

pytestmark = pytest.mark.usefixtures("fresh_inductor")

OPTIONS = dict(bucketing="manual", bucket_plan=["layers.[0-1]"], strict=True, memory_budget="1GB")


def test_dynamic_batch_is_planned_with_size_hints():
    fsdp_passes.last_reports(clear=True)
    with fake_process_group(8):
        model = build_mlp(2, 32)
        (x,) = example_inputs(model, batch=4)
        torch._dynamo.mark_dynamic(x, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            caps = capture_scheduler_nodes(model, x, options=OPTIONS)
    assert len(caps) == 2
    reports = fsdp_passes.last_reports(clear=True)
    fx = [r for r in reports if r.pass_name == "fx"]
    sched = [r for r in reports if r.pass_name == "scheduler"]
    assert len(fx) == 2 and len(sched) == 2
    assert all(r.fallback is None for r in reports)
    # the parameters are static: their gathers are bucketed even though activations are symbolic
    assert fx[0].n_collectives_after < fx[0].n_collectives_before
    assert all(r.collective_fingerprint for r in sched)


def test_dynamic_true_compile_runs():
    fsdp_passes.last_reports(clear=True)
    with fake_process_group(8):
        model = build_mlp(2, 32)
        with fsdp_passes.enabled(**OPTIONS):
            compiled = torch.compile(model, dynamic=True)
            for batch in (2, 6):
                compiled(*example_inputs(model, batch=batch)).sum().backward()
    reports = fsdp_passes.last_reports(clear=True)
    assert reports and all(r.fallback is None for r in reports)


class _Unbacked(torch.nn.Module):
    """An FSDP MLP whose activations pass through a boolean mask: a data-dependent (unbacked) size."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        h = self.inner.layers[0](x)
        h = h[h > 0]  # nonzero: unbacked length
        return self.inner.layers[1](h.view(-1, 1).expand(-1, 32).contiguous()).sum()


def test_unbacked_sizes_leave_graph_untouched_with_one_log_line(caplog):
    fsdp_passes.last_reports(clear=True)
    with fake_process_group(8):
        model = _Unbacked(build_mlp(2, 32))
        x = torch.randn(4, 32)
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), warnings.catch_warnings(), \
                caplog.at_level(logging.INFO, logger="fsdp_passes"):
            warnings.simplefilter("error", RuntimeWarning)  # a fallback would warn: this must not
            caps = capture_scheduler_nodes(model, x, options=OPTIONS)  # strict: a failure would raise
    assert caps
    reports = fsdp_passes.last_reports(clear=True)
    untouched = [r for r in reports if r.fallback and r.fallback.startswith("left untouched")]
    assert untouched, [(r.graph, r.pass_name, r.fallback) for r in reports]
    assert all("unbacked" in r.fallback or "no hint" in r.fallback for r in untouched)
    lines = [rec for rec in caplog.records if "left untouched" in rec.getMessage()]
    assert len(lines) == len(untouched)
    # ours only: torch warns once per process about checkpoint under compile, so whether its line lands here
    # depends on which test compiled first
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING and rec.name.startswith("fsdp_passes")]
