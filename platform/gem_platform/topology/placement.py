"""Topology-aware rank placement on Ray, and the check that Ray honoured it.

Ray's PACK placement groups don't keep bundles node-contiguous, and Ray Train numbers workers
by node in the order it meets them, so we never rely on either: ranks are assigned to nodes
here (hosts contiguous, zones contiguous), each worker is pinned to its node (a node-affinity
scheduling strategy, or a per-worker label selector on the node id), and every worker reports
where it really runs so `verify_placement` can fail loudly before training starts.

A Ray node is a host; its zone is the value of the ``parallel.zone_label`` node label (set with
``ray start --labels`` / ``ray.init(labels=...)``; nodes without it share the zone "default").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gem_platform.errors import ClusterError
from gem_platform.topology.cluster import Cluster, Host, Placement
from gem_platform.topology.config import ParallelConfig

NODE_ID_LABEL = "ray.io/node-id"
DEFAULT_ZONE = "default"


@dataclass(frozen=True)
class NodeInfo:
    """An alive Ray node: its id, address, zone label and total CPU/GPU resources."""

    node_id: str
    address: str
    zone: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class WorkerLocation:
    """Where a worker process actually runs, as it reports itself."""

    rank: int
    node_id: str
    zone: str


def nodes_from_ray_state(raw_nodes: Sequence[Mapping[str, Any]], zone_label: str) -> list[NodeInfo]:
    """Convert ``ray.nodes()`` entries (alive ones only) into NodeInfo."""
    out = []
    for n in raw_nodes:
        if not n.get("Alive", False):
            continue
        res = n.get("Resources", {})
        labels = n.get("Labels", {}) or {}
        out.append(
            NodeInfo(
                node_id=n["NodeID"],
                address=n.get("NodeManagerAddress", ""),
                zone=labels.get(zone_label, DEFAULT_ZONE),
                cpus=float(res.get("CPU", 0.0)),
                gpus=float(res.get("GPU", 0.0)),
            )
        )
    return out


def slots_on(node: NodeInfo, parallel: ParallelConfig) -> int:
    """Worker slots a node offers: its GPUs (GPU runs) or CPUs / cpus_per_worker (CPU runs),
    capped at ``parallel.gpus_per_host`` when that is set."""
    by_cpu = int(node.cpus // parallel.cpus_per_worker)
    capacity = min(int(node.gpus), by_cpu) if parallel.use_gpu else by_cpu
    return capacity if parallel.gpus_per_host is None else min(capacity, parallel.gpus_per_host)


def cluster_from_nodes(nodes: Sequence[NodeInfo], parallel: ParallelConfig) -> Cluster:
    """Hosts = nodes with at least one slot; zones by label, ordered by name; hosts inside a
    zone ordered by (address, node id) so the order is stable across calls."""
    hosts = [
        Host(
            name=f"{n.address}/{n.node_id[:8]}",
            zone=n.zone,
            slots=slots_on(n, parallel),
            node_id=n.node_id,
        )
        for n in sorted(nodes, key=lambda n: (n.zone, n.address, n.node_id))
    ]
    return Cluster.from_hosts(hosts)


def discover_cluster(parallel: ParallelConfig) -> Cluster:
    """The running Ray cluster (``ray.init`` already called) as zones of hosts."""
    import ray

    nodes = nodes_from_ray_state(ray.nodes(), parallel.zone_label)
    cluster = cluster_from_nodes(nodes, parallel)
    if not cluster.zones:
        kind = "GPU" if parallel.use_gpu else f"{parallel.cpus_per_worker} CPU"
        raise ClusterError(
            f"No alive Ray node offers a worker slot ({kind} per worker).",
            "Start nodes with enough resources or lower parallel.cpus_per_worker.",
        )
    return cluster


def place_on_ray(parallel: ParallelConfig) -> Placement:
    """Discover the Ray cluster and assign ``parallel.workers`` ranks to its nodes."""
    return discover_cluster(parallel).place(parallel.workers)


def _node_id(placement: Placement, rank: int) -> str:
    node_id = placement[rank].node_id
    if node_id is None:
        raise ClusterError(
            f"Rank {rank} is placed on host {placement[rank].host}, which is not a Ray node.",
            "Build the placement from the Ray cluster (place_on_ray), not from counts.",
        )
    return node_id


def scheduling_strategy(placement: Placement, rank: int) -> Any:
    """A hard node-affinity strategy pinning ``rank``'s actor to its node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=_node_id(placement, rank), soft=False)


def label_selectors(placement: Placement) -> list[dict[str, str]]:
    """Per-worker label selectors for Ray Train's ``ScalingConfig(label_selector=...)``: worker
    i must run on the node of rank i. Ray Train then numbers workers node by node in bundle
    order, which is our rank order because each host's ranks are contiguous."""
    return [{NODE_ID_LABEL: _node_id(placement, r)} for r in range(placement.world)]


def worker_location(rank: int, zone_label: str = "gem.zone") -> WorkerLocation:
    """Called inside a Ray worker: the node it runs on and that node's zone label."""
    import ray

    ctx = ray.get_runtime_context()
    zone = ctx.get_node_labels().get(zone_label, DEFAULT_ZONE)
    return WorkerLocation(rank=rank, node_id=ctx.get_node_id(), zone=str(zone))


def verify_placement(
    expected: Placement, actual: Sequence[WorkerLocation] | Mapping[int, str]
) -> None:
    """Raise ClusterError listing every rank that runs on another node or zone than planned,
    or that did not report at all. ``actual`` is the workers' reports, or rank -> node id
    (zones then follow from the nodes). Passing means the process groups span the tiers the
    plan says."""
    if isinstance(actual, Mapping):
        zones = {s.node_id: s.zone for s in expected.slots}
        actual = [WorkerLocation(r, n, zones.get(n, "?")) for r, n in actual.items()]
    seen = {loc.rank: loc for loc in actual}
    problems = []
    for slot in expected.slots:
        loc = seen.pop(slot.rank, None)
        if loc is None:
            problems.append(f"rank {slot.rank} did not report its location")
        elif loc.node_id != slot.node_id or loc.zone != slot.zone:
            problems.append(
                f"rank {slot.rank} should run on node {str(slot.node_id)[:8]} (zone {slot.zone}) "
                f"but runs on node {loc.node_id[:8]} (zone {loc.zone})"
            )
    problems += [f"unexpected rank {r} reported (world is {expected.world})" for r in sorted(seen)]
    if problems:
        shown = "; ".join(problems[:8]) + (
            f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        )
        raise ClusterError(
            f"Ray placed workers differently from the topology plan: {shown}.",
            "Pin each worker to its node (scheduling_strategy / label_selectors from this "
            "placement) instead of relying on PACK placement groups, and make sure every "
            "planned node has free resources for its workers.",
        )
