"""Cost model: milliseconds per DAG node.

α–β collectives with NCCL-like algorithm choice on a cluster profile (``profiles``, ``collectives``),
roofline compute (``roofline``; FLOPs from ``dag.flops``), and measured calibration tables that override both
(``calibration``, ``calibrate``).  ``CostModel`` puts them together.  A profile's measured prices of small
collectives are fitted to a sweep by ``fit_small_collectives`` (``bands``).
"""

from .bands import fit_small_collectives
from .calibration import Calibration, shapes_key
from .collectives import CollectiveEstimate, GroupTopology, collective_ms, estimate_collective, group_topology
from .model import CostModel
from .profiles import ClusterProfile, available_profiles, load_profile, profile_from_mapping
from .roofline import compute_ms
from .trace_calibration import calibrate_from_trace

__all__ = [
    "Calibration",
    "ClusterProfile",
    "CollectiveEstimate",
    "CostModel",
    "GroupTopology",
    "calibrate_from_trace",
    "available_profiles",
    "collective_ms",
    "compute_ms",
    "estimate_collective",
    "fit_small_collectives",
    "group_topology",
    "load_profile",
    "profile_from_mapping",
    "shapes_key",
]
