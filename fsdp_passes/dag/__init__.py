"""Neutral dependency DAG built from FX graphs and from Inductor scheduler nodes."""

from .graph import CollectiveOp, Dag, DagNode, NodeKind, buffer_roots

__all__ = ["CollectiveOp", "Dag", "DagNode", "NodeKind", "buffer_roots"]
