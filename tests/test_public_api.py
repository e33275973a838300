"""The top-level names: every one in ``__all__`` resolves; the errors a caller catches are reachable from
``fsdp_passes`` (one class each, the one the passes raise) without importing Inductor up front."""

from __future__ import annotations

import subprocess
import sys

import fsdp_passes


def test_every_exported_name_resolves():
    for name in fsdp_passes.__all__:
        assert getattr(fsdp_passes, name) is not None, name


def test_errors_are_the_classes_the_passes_raise():
    from fsdp_passes.bucketing.manual import UnmatchedPlanEntry
    from fsdp_passes.inductor.guard import FsdpPassError
    from fsdp_passes.inductor.scheduler_pass import InvalidOrder
    from fsdp_passes.options import OptionError
    from fsdp_passes.pipeline.budget import BucketOverBudget

    assert fsdp_passes.FsdpPassError is FsdpPassError and issubclass(FsdpPassError, RuntimeError)
    for top, own in ((fsdp_passes.InvalidOrder, InvalidOrder), (fsdp_passes.BucketOverBudget, BucketOverBudget),
                     (fsdp_passes.UnmatchedPlanEntry, UnmatchedPlanEntry), (fsdp_passes.OptionError, OptionError)):
        assert top is own and issubclass(top, ValueError), top


def test_an_option_error_is_caught_by_the_exported_class():
    # an Options error is caught as fsdp_passes.OptionError (a ValueError): what enable() raises
    try:
        fsdp_passes.enable(memory_budget="lots")
    except fsdp_passes.OptionError as exc:
        assert "memory_budget" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("enable(memory_budget='lots') did not raise")


def test_import_does_not_load_inductor():
    code = ("import sys, fsdp_passes; assert 'torch._inductor' not in sys.modules; "
            "fsdp_passes.BucketOverBudget; assert 'torch._inductor' not in sys.modules; "
            "fsdp_passes.FsdpPassError; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_every_option_rejection_is_an_option_error_naming_the_option():
    from fsdp_passes.options import Options

    cases = [
        (lambda: fsdp_passes.enable(bogus=1), "bogus"),
        (lambda: fsdp_passes.enable(options={"reorder": True}), "options"),
        (lambda: Options.from_env(environ={"FSDP_PASSES_REORDR": "1"}), "FSDP_PASSES_REORDR"),
        (lambda: Options.from_env(environ={"FSDP_PASSES_STRICT": "maybe"}), "strict"),
        (lambda: Options.from_env(environ={"FSDP_PASSES_CLUSTER": '{"base": "h100-nvlink"'}), "cluster"),
        (lambda: Options.from_env(environ={"FSDP_PASSES_BUCKET_PLAN": "layers.0"}), "bucket_plan"),
        (lambda: Options.from_env(environ={"FSDP_PASSES_MAX_PREFETCH": "0"}), "max_prefetch"),
        # a combination (manual bucketing, no plan): the option Options rejects, and the variables applied
        (lambda: Options.from_env(environ={"FSDP_PASSES_BUCKETING": "manual"}), "bucket_plan"),
    ]
    for make, option in cases:
        try:
            make()
        except fsdp_passes.OptionError as exc:
            assert exc.option == option, (option, exc.option, str(exc))
            assert option.upper() in str(exc).upper(), str(exc)
            if "is not valid: expected a plan" in str(exc):
                assert "FSDP_PASSES_BUCKETING='manual'" in str(exc), str(exc)
        else:  # pragma: no cover
            raise AssertionError(f"no OptionError for {option}")
