"""``python -m fsdp_passes simulate DUMP_DIR``: what-if, dumped graphs re-estimated on another cluster / world size."""

from __future__ import annotations

import argparse
import os

from ..cost_model import load_profile
from ..debug.dag_json import read_dag_json
from ..debug.reader import DumpError, load_dumps
from ..debug.whatif import what_if, what_if_table
from .common import CliError, say as _say

__all__ = ["cmd_simulate"]


def cmd_simulate(args: argparse.Namespace) -> int:
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
    for d in dumps:
        path = d.file("dag.json")
        if not os.path.isfile(path):
            raise DumpError(f"{path}: no such file (the dump has no DAG to re-estimate)")
        try:
            dump = read_dag_json(path)
        except ValueError as exc:
            raise DumpError(str(exc)) from None
        dump.graph = dump.graph or d.name
        results.append(what_if(dump, profile, world_size=args.world_size, fixed=args.fixed,
                               calibration=args.calibration, replan=not args.no_replan))
    world = f"world size {args.world_size}" if args.world_size else "dumped world size"
    _say(f"what-if for {args.dir}: cluster {profile.name}, {world}"
         + (f" ({args.fixed} size fixed)" if args.world_size else ""))
    _say(what_if_table(results).rstrip("\n"))
    planners = sorted({r.planner for r in results})
    _say("re-planned: " + "; ".join(planners))
    _say("before: order the scheduler pass received; dumped order: the order it chose, re-timed; "
         "re-planned: a new plan for these numbers. Times are per graph; a step runs each graph once.")
    return 0
