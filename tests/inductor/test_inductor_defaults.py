"""Inductor settings the kernel prediction (``fsdp_passes.dag.fusion``, which may not import Inductor) mirrors,
held against the installed Inductor."""

from torch._inductor import config as inductor_config

from fsdp_passes.dag.fusion import REALIZE_READS_THRESHOLD, UNROLL_REDUCTIONS_THRESHOLD


def test_realize_reads_threshold_is_inductors():
    assert REALIZE_READS_THRESHOLD == inductor_config.realize_reads_threshold


def test_unroll_reductions_threshold_is_inductors():
    assert UNROLL_REDUCTIONS_THRESHOLD == inductor_config.unroll_reductions_threshold
