"""Bucketing policy: which FSDP collectives to merge (``plan_manual``, ``plan_auto`` and auto's other
candidates ``plan_per_block`` / ``plan_unmerged``) and the FX rewrite that merges them (``apply_buckets``).
No simulation here: ``fsdp_passes.pipeline`` chooses among plans and runs ``bucket_graph`` on a graph.
See docs/bucketing.md.
"""

from __future__ import annotations

from .auto import plan_auto
from .blocks import block_keys, plan_per_block, plan_unmerged
from .manual import UnmatchedPlanEntry, describe_entries, expand_pattern, expand_plan, plan_manual
from .plan import Bucket, BucketPlanResult, break_cycles, fsdp_payload_bytes, plan_cycles
from .placement import issue_gathers_before_reductions, renumbered
from .rewrite import BUCKET_META_KEY, RewriteStats, apply_buckets

__all__ = [
    "BUCKET_META_KEY",
    "Bucket",
    "BucketPlanResult",
    "RewriteStats",
    "UnmatchedPlanEntry",
    "apply_buckets",
    "block_keys",
    "break_cycles",
    "describe_entries",
    "expand_pattern",
    "expand_plan",
    "fsdp_payload_bytes",
    "issue_gathers_before_reductions",
    "plan_auto",
    "plan_cycles",
    "plan_manual",
    "plan_per_block",
    "plan_unmerged",
    "renumbered",
]
