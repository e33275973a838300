"""``python -m fsdp_passes simulate DUMP_DIR``: what-if, dumped graphs re-estimated on another cluster / world size."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..cost_model import load_profile
from ..debug.dag_json import read_dag_json
from ..debug.reader import DumpError, load_dumps
from ..debug.whatif import what_if, what_if_table, world_size_of
from ..options import Options
from .common import CliError, say as _say

__all__ = ["cmd_simulate"]


def cmd_simulate(args: argparse.Namespace) -> int:
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


def _dumped_profile(dump: Any, path: str) -> Any:
    """The cluster profile a dump was priced with (``dag.json``'s ``meta``); the shipped default when an
    older dump did not record it."""
    cluster = dump.meta.get("cluster")
    if cluster is None:
        cluster = Options().cluster
    try:
        return load_profile(cluster)
    except ValueError as exc:
        raise DumpError(f"{path}: the dumped cluster cannot be loaded ({exc}); give --cluster") from None
