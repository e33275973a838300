"""Inspecting schedules: per-graph dump folders, the lossless ``dag.json`` form, text tables and what-if
re-estimation.  See docs/user-guide.md, "Reading the dumps"."""

from .dag_json import DagDump, DagJsonError, dag_from_json, dag_to_json, load_dag_dump, read_dag_json
from .dump import (
    DUMP_FILES,
    SUMMARY_KEYS,
    build_summary,
    emit_artifacts,
    graph_dir,
    log_move_reasons,
    move_reasons,
    write_bucketing_dump,
    write_scheduler_dump,
)
from .reader import DumpError, GraphDump, load_dumps, pair_dumps
from .tables import parse_schedule_table, schedule_rows, schedule_table, summary_table

__all__ = [
    "DUMP_FILES",
    "DagDump",
    "DagJsonError",
    "DumpError",
    "GraphDump",
    "SUMMARY_KEYS",
    "build_summary",
    "dag_from_json",
    "dag_to_json",
    "emit_artifacts",
    "graph_dir",
    "load_dag_dump",
    "load_dumps",
    "log_move_reasons",
    "move_reasons",
    "pair_dumps",
    "parse_schedule_table",
    "read_dag_json",
    "schedule_rows",
    "schedule_table",
    "summary_table",
    "write_bucketing_dump",
    "write_scheduler_dump",
]
