"""``python -m fsdp_passes`` (console script ``fsdp-passes``): demo, report, simulate, calibrate.

    python -m fsdp_passes demo [--layers 4 --dim 256 --world-size 8 --cluster h100-nvlink --bucketing auto]
    python -m fsdp_passes report DUMP_DIR [OTHER_DUMP_DIR]
    python -m fsdp_passes simulate DUMP_DIR --cluster a100 --world-size 64
    python -m fsdp_passes calibrate --out calibration.json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

PROG = "python -m fsdp_passes"  # how ``python -m`` runs it; the console script is named by ``prog_name``


def prog_name(argv0: str | None = None) -> str:
    """The command as the user typed it: the console script's name (``fsdp-passes``) when it is what runs,
    else ``python -m fsdp_passes`` (also when ``main`` is called from another program)."""
    base = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    if base.startswith("fsdp") and not base.endswith(".py"):
        return base
    return PROG


NOTE = ("collectives: before bucketing -> after; exposed comm, makespan, peak memory: the schedule the "
        "reordering pass received (already bucketed) -> the one it chose; all simulated with the cost model.")


BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader closed the pipe


class CliError(Exception):
    """An error to report as one line on stderr (exit code 2)."""


def _say(text: str) -> None:
    print(text, flush=True)


# -- report ---------------------------------------------------------------------------------------------------


def _print_report(root: str, header: bool = True) -> None:
    from .debug.reader import load_dumps
    from .debug.tables import summary_table, totals_table

    dumps = load_dumps(root)
    if header:
        _say(f"{len(dumps)} graph(s) in {root}")
    for d in dumps:
        _say("")
        _say(summary_table(d.summary).rstrip("\n"))
    if len(dumps) > 1:
        _say("")
        _say(totals_table([d.summary for d in dumps]).rstrip("\n"))
    _say("")
    _say(NOTE)


def _print_comparison(root_a: str, root_b: str) -> None:
    from .debug.reader import load_dumps, pair_dumps
    from .debug.tables import comparison_table, totals

    a, b = load_dumps(root_a), load_dumps(root_b)
    _say(f"A = {root_a} ({len(a)} graphs)")
    _say(f"B = {root_b} ({len(b)} graphs)")
    for da, db in pair_dumps(a, b):
        _say("")
        if da is None or db is None:
            only, where = (da, "A") if db is None else (db, "B")
            _say(f"{only.name}: only in {where}")
            continue
        _say(comparison_table(da.summary, db.summary).rstrip("\n"))
    ta = totals([d.summary for d in a])
    tb = totals([d.summary for d in b])
    ta["graph"] = tb["graph"] = "all graphs (step = sum of makespans)"
    _say("")
    _say(comparison_table(ta, tb).rstrip("\n"))
    _say("")
    _say(NOTE)


def cmd_report(args: argparse.Namespace) -> int:
    if args.other is None:
        _print_report(args.dir)
    else:
        _print_comparison(args.dir, args.other)
    return 0


# -- demo -----------------------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from .debug.demo import DemoConfig, run_demo

    cfg = DemoConfig(layers=args.layers, dim=args.dim, world_size=args.world_size, cluster=args.cluster,
                     bucketing=args.bucketing, out=args.out, full_compile=args.full_compile,
                     seq_len=args.seq_len)
    result = run_demo(cfg, say=_say)
    _say(f"done in {result.seconds:.1f} s")
    _say("")
    _print_report(result.out, header=False)
    from .debug.reader import load_dumps

    dumps = load_dumps(result.out)
    if result.baseline is not None:
        _say("")
        _say(_headline(load_dumps(result.baseline), dumps))
    _say("")
    files = dumps[0].summary.get("files") if dumps else None
    _say(f"dumps: {result.out}/<graph>/ ({', '.join(files or ['summary.json'])})")
    skipped = {k: v for d in dumps for k, v in (d.summary.get("skipped_files") or {}).items()}
    for why in skipped.values():
        _say(f"  {why}")
    for d in dumps:
        _say(f"trace: {d.file('trace.json')}  (open in https://ui.perfetto.dev)")
    _say(f"again: {prog_name()} report {result.out}")
    if result.baseline is not None:
        _say(f"graph by graph against no passes: {prog_name()} report {result.baseline} {result.out}")
    return 0


def _headline(baseline: list, passes: list) -> str:
    """The step (all graphs) without any pass -> with the passes: the demo's comparable headline."""
    from .debug.tables import summary_table, totals

    before = totals([d.summary for d in baseline])
    after = totals([d.summary for d in passes])
    step = {"graph": f"step without any pass ({len(baseline)} graphs) -> with the passes ({len(passes)} graphs)"}
    for key in ("n_collectives", "exposed_comm_ms", "makespan_ms", "peak_memory_bytes"):
        step[f"{key}_before"] = before[f"{key}_after"]
        step[f"{key}_after"] = after[f"{key}_after"]
    step["lower_bound_ms"] = after["lower_bound_ms"]
    return summary_table(step).rstrip("\n")


# -- simulate -------------------------------------------------------------------------------------------------


def cmd_simulate(args: argparse.Namespace) -> int:
    from .cost_model import load_profile
    from .debug.dag_json import read_dag_json
    from .debug.reader import DumpError, load_dumps
    from .debug.whatif import what_if, what_if_table, world_size_of

    profile = None
    if args.cluster is not None:
        try:
            profile = load_profile(args.cluster)
        except ValueError as exc:
            raise CliError(f"--cluster: {exc}") from None
    if args.world_size is not None and args.world_size < 1:
        raise CliError(f"--world-size {args.world_size}: expected an integer >= 1")
    if args.calibration is not None and not os.path.isfile(args.calibration):
        raise CliError(f"--calibration {args.calibration}: no such file")
    dumps = load_dumps(args.dir)
    results = []
    clusters, worlds = [], []
    for d in dumps:
        path = d.file("dag.json")
        if not os.path.isfile(path):
            raise DumpError(f"{path}: no such file (the dump has no DAG to re-estimate)")
        try:
            dump = read_dag_json(path)
        except ValueError as exc:
            raise DumpError(str(exc)) from None
        dump.graph = dump.graph or d.name
        graph_profile = profile if profile is not None else _dumped_profile(dump, path)
        clusters.append(graph_profile.name)
        worlds.append(args.world_size or dump.meta.get("world_size") or world_size_of(dump.dag))
        results.append(what_if(dump, graph_profile, world_size=args.world_size, fixed=args.fixed,
                               calibration=args.calibration, replan=not args.no_replan))
    cluster = ", ".join(dict.fromkeys(clusters)) + ("" if profile is not None else " (from the dump)")
    world_sizes = ", ".join(str(w) for w in dict.fromkeys(worlds) if w is not None) or "?"
    world = f"world size {args.world_size}" if args.world_size else f"world size {world_sizes} (from the dump)"
    _say(f"what-if for {args.dir}: cluster {cluster}, {world}"
         + (f" ({args.fixed} size fixed)" if args.world_size else ""))
    _say(what_if_table(results).rstrip("\n"))
    planners = sorted({r.planner for r in results})
    _say("re-planned: " + "; ".join(planners))
    _say("before: order the scheduler pass received; dumped order: the order it chose, re-timed; "
         "re-planned: a new plan for these numbers. Times are per graph; a step runs each graph once.")
    return 0


def _dumped_profile(dump, path: str):
    """The cluster profile a dump was priced with (``dag.json``'s ``meta``); the shipped default when an
    older dump did not record it."""
    from .cost_model import load_profile
    from .debug.reader import DumpError
    from .options import Options

    cluster = dump.meta.get("cluster")
    if cluster is None:
        cluster = Options().cluster
    try:
        return load_profile(cluster)
    except ValueError as exc:
        raise DumpError(f"{path}: the dumped cluster cannot be loaded ({exc}); give --cluster") from None


# -- calibrate ------------------------------------------------------------------------------------------------


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .cost_model import calibrate

    return calibrate.run(args)


# -- parser ---------------------------------------------------------------------------------------------------


def _profiles() -> list[str]:
    from .cost_model import available_profiles

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

    demo = sub.add_parser(
        "demo", formatter_class=_DefaultsFormatter,
        help="run the passes on a built-in Llama-style model (CPU, fake process group) and show the result",
        description="Build a Llama-style model, shard it SimpleFSDP-style over a fake process group, compile "
                    "forward and backward with the passes on (stopping after Inductor's scheduler), write dumps and "
                    "print what the passes did. Needs no GPU and no cluster.",
    )
    demo.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    demo.add_argument("--dim", type=int, default=256, help="model width; a multiple of the world size (default 256)")
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
    demo.set_defaults(func=cmd_demo)

    report = sub.add_parser(
        "report", formatter_class=_DefaultsFormatter,
        help="print the tables of a dump folder, or compare two",
        description="Print per-graph tables (collectives, exposed comm, makespan, peak memory before -> after, "
                    "lower bound) of a dump folder written with debug_dir; with a second folder, compare them "
                    "side by side (graphs matched by name, else in compile order).",
    )
    report.add_argument("dir", help="dump folder (the debug_dir, or one graph's folder in it)")
    report.add_argument("other", nargs="?", default=None, help="a second dump folder to compare with")
    report.set_defaults(func=cmd_report)

    simulate = sub.add_parser(
        "simulate", formatter_class=_DefaultsFormatter,
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
    simulate.set_defaults(func=cmd_simulate)

    cal = sub.add_parser(
        "calibrate", formatter_class=_DefaultsFormatter,
        help="measure collective times on this machine / job and write a calibration table",
        description="Measure collective times (under torchrun: on the job's ranks; otherwise on --world-size local "
                    "gloo processes) and write a calibration JSON for Options(calibration=...).",
    )
    from .cost_model import calibrate

    calibrate.add_arguments(cal)
    cal.set_defaults(func=cmd_calibrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (errors: one line on stderr, code 2)."""
    from .debug.dag_json import DagJsonError
    from .debug.reader import DumpError

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


if __name__ == "__main__":
    sys.exit(main())
