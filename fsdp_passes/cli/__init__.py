"""The command line, ``python -m fsdp_passes`` (console script ``fsdp-passes``): one module per command.

    python -m fsdp_passes demo [--layers 4 --dim 256 --world-size 8 --cluster h100-nvlink --bucketing auto]
    python -m fsdp_passes report DUMP_DIR [OTHER_DUMP_DIR]
    python -m fsdp_passes simulate DUMP_DIR --cluster a100 --world-size 64
    python -m fsdp_passes calibrate --out calibration.json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from ..debug.dag_json import DagJsonError
from ..debug.reader import DumpError
from . import calibrate
from .common import BROKEN_PIPE_EXIT, CliError, prog_name
from .demo import cmd_demo
from .report import cmd_report
from .simulate import cmd_simulate

__all__ = ["build_parser", "main"]


def _profiles() -> list[str]:
    from ..cost_model import available_profiles

    return available_profiles()


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where the help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.required or action.nargs == 0 or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog_name(),
        formatter_class=_DefaultsFormatter,
        description="Bucketing and overlap scheduling of FSDP collectives in torch.compile: demo, inspect dumps, "
                    "what-if estimates, calibration.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = _add_command(
        sub, "demo", cmd_demo,
        help="run the passes on a built-in Llama-style model (CPU, fake process group) and show the result",
        description="Build a Llama-style model, shard it SimpleFSDP-style over a fake process group, compile "
                    "forward and backward with the passes on (stopping after Inductor's scheduler), write dumps and "
                    "print what the passes did. Needs no GPU and no cluster.",
    )
    demo.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    demo.add_argument("--dim", type=int, default=256, help="model width; a multiple of the heads (4 below 256, else dim / 64) (default 256)")
    demo.add_argument("--seq-len", type=int, default=256, help="sequence length (default 256)")
    demo.add_argument("--world-size", type=int, default=8, help="ranks of the fake process group (default 8)")
    demo.add_argument("--cluster", default="h100-nvlink",
                      help="cluster profile the cost model uses: a shipped name or a profile JSON file "
                           "(default h100-nvlink; shipped: " + ", ".join(_profiles()) + ")")
    demo.add_argument("--bucketing", choices=("auto", "manual", "none"), default="auto",
                      help="auto: cost-model planner; manual: one bucket per layer; none (default auto)")
    demo.add_argument("--out", default="./fsdp_dumps", help="dump folder (default ./fsdp_dumps)")
    demo.add_argument("--full-compile", action="store_true",
                      help="run a real torch.compile step (builds C++ kernels: much slower on CPU)")

    report = _add_command(
        sub, "report", cmd_report,
        help="print the tables of a dump folder, or compare two",
        description="Print per-graph tables (collectives, exposed comm, makespan, peak memory before -> after, "
                    "lower bound) of a dump folder written with debug_dir; with a second folder, compare them "
                    "side by side (graphs matched by name, else in compile order).",
    )
    report.add_argument("dir", help="dump folder (the debug_dir, or one graph's folder in it)")
    report.add_argument("other", nargs="?", default=None, help="a second dump folder to compare with")

    simulate = _add_command(
        sub, "simulate", cmd_simulate,
        help="what-if: re-estimate dumped graphs on another cluster profile / world size",
        description="Reload each graph's dag.json, re-estimate every node on another cluster profile (and world "
                    "size), and print the predicted time and exposed communication of the order before the pass, "
                    "of the order it chose, and of a fresh plan. World-size scaling resizes the process groups "
                    "as large as the dumped world; with --fixed model (default) full parameter / gradient sizes "
                    "stay and shards shrink, with --fixed shard shard sizes stay and full sizes grow with the "
                    "group. Compute is unchanged (same per-rank batch).",
    )
    simulate.add_argument("dir", help="dump folder")
    simulate.add_argument("--cluster", default=None,
                          help="cluster profile name or JSON file (default: the cluster the dump was made with, "
                               "recorded in its dag.json; shipped: " + ", ".join(_profiles()) + ")")
    simulate.add_argument("--world-size", type=int, default=None,
                          help="resize the world-sized process groups to this many ranks (default: the world "
                               "size the dump was made with)")
    simulate.add_argument("--fixed", choices=("model", "shard"), default="model",
                          help="what stays fixed when the world size changes (default model)")
    simulate.add_argument("--calibration", default=None, help="calibration JSON file to price nodes with")
    simulate.add_argument("--no-replan", action="store_true", help="do not run the planner again")

    cal = _add_command(
        sub, "calibrate", calibrate.run,
        help="measure collective times on this machine / job and write a calibration table",
        description="Measure collective times (under torchrun: on the job's ranks; otherwise on --world-size local "
                    "gloo processes) and write a calibration JSON for Options(calibration=...).",
    )
    calibrate.add_arguments(cal)
    return parser


def _add_command(sub: argparse._SubParsersAction, name: str, func: Callable[[argparse.Namespace], int], *,
                 help: str, description: str) -> argparse.ArgumentParser:
    """The parser of one command (``--help`` shows each option's default), which runs ``func``."""
    parser = sub.add_parser(name, formatter_class=_DefaultsFormatter, help=help, description=description)
    parser.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (errors: one line on stderr, code 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = parser.prog
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader went away (``report DIR | head -1``): end quietly, as a killed pipe does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail again
        return BROKEN_PIPE_EXIT
    except (CliError, DumpError, DagJsonError) as exc:
        print(f"{prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:  # bad option values (cluster name, sizes...), unwritable folders
        print(f"{prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog} {args.command}: interrupted", file=sys.stderr)
        return 130
