"""Topology: the cluster as zones of hosts of ranks, the process groups of each parallel
dimension, the network tier each collective crosses, and rank placement on Ray.

Ray itself is imported only by the functions that talk to it (placement.py), so planning
works without a Ray runtime.
"""

from gem_platform.topology.cluster import (
    Cluster,
    ClusterShape,
    Host,
    Placement,
    RankSlot,
    Tier,
    Zone,
)
from gem_platform.topology.config import ParallelConfig
from gem_platform.topology.costs import Collective, ModelSizes
from gem_platform.topology.mesh import GroupKind, GroupSet, Mesh, ProcessGroup, resolve_mesh
from gem_platform.topology.placement import (
    NodeInfo,
    WorkerLocation,
    cluster_from_nodes,
    discover_cluster,
    label_selectors,
    place_on_ray,
    scheduling_strategy,
    verify_placement,
    worker_location,
)
from gem_platform.topology.plan import COLUMNS, GROUP_COLUMNS, Plan, build_plan

__all__ = [
    "COLUMNS",
    "GROUP_COLUMNS",
    "Cluster",
    "ClusterShape",
    "Collective",
    "GroupKind",
    "GroupSet",
    "Host",
    "Mesh",
    "ModelSizes",
    "NodeInfo",
    "ParallelConfig",
    "Placement",
    "Plan",
    "ProcessGroup",
    "RankSlot",
    "Tier",
    "WorkerLocation",
    "Zone",
    "build_plan",
    "cluster_from_nodes",
    "discover_cluster",
    "label_selectors",
    "place_on_ray",
    "resolve_mesh",
    "scheduling_strategy",
    "verify_placement",
    "worker_location",
]
