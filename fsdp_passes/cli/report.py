"""``python -m fsdp_passes report DUMP_DIR [OTHER_DUMP_DIR]``: the tables of a dump folder, or two side by side."""

from __future__ import annotations

import argparse

from ..debug.reader import load_dumps, pair_dumps
from ..debug.tables import comparison_table, summary_table, totals, totals_table
from .common import NOTE, say as _say

__all__ = ["cmd_report", "print_report"]


def print_report(root: str, header: bool = True) -> None:
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
        print_report(args.dir)
    else:
        _print_comparison(args.dir, args.other)
    return 0
