"""Per graph: plan buckets within the memory budget -> place gathers -> reorder within the rest -> report.

Sits above the two policies (``bucketing``, ``reordering``) and the engine (``simulate``): ``bucket_graph``
runs the FX half, ``choice`` is auto's choice among candidate plans (a rank-invariant overlap model, no
rewrite or simulation) and the memory claim of a plan, ``reorder_graph`` the scheduler half, ``report``
holds what each pass did to a graph.
"""

from __future__ import annotations

from .bucket_graph import BucketingResult, bucket_graph
from .plans import plan_bucketing
from .reorder_graph import finish_graph_report, plan_graph_order
from .report import GraphBudget, GraphReport, collective_fingerprint, collective_sequence, fill_schedule_numbers

__all__ = [
    "BucketingResult",
    "GraphBudget",
    "GraphReport",
    "bucket_graph",
    "collective_fingerprint",
    "collective_sequence",
    "fill_schedule_numbers",
    "finish_graph_report",
    "plan_bucketing",
    "plan_graph_order",
]
