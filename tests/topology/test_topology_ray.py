"""Placement on a real (fake multi-node) Ray cluster: discovery by zone label, pinned actors and
Ray Train workers, and verification of where each one really runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gem_platform.errors import ClusterError
from gem_platform.topology import (
    Cluster,
    ClusterShape,
    GroupKind,
    ModelSizes,
    ParallelConfig,
    Tier,
    WorkerLocation,
    Zone,
    build_plan,
    discover_cluster,
    label_selectors,
    place_on_ray,
    scheduling_strategy,
    verify_placement,
    worker_location,
)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster as RayCluster  # noqa: E402

pytestmark = pytest.mark.slow

# Two zones: "za" with two hosts (the head node is one of them), "zb" with one; each host
# offers 2 CPU worker slots. Labels are the only thing telling discovery about zones.
NODES = [("zb", 2), ("za", 2)]
PARALLEL = ParallelConfig(
    workers=6, gpus_per_host=2, hsdp_shard_group=2, expert_parallel=2, expert_shard_hosts=1
)


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = RayCluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "labels": {"gem.zone": "za"}}
    )
    for zone, cpus in NODES:
        cluster.add_node(num_cpus=cpus, labels={"gem.zone": zone})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@ray.remote(num_cpus=1)
class Probe:
    def where(self, rank: int) -> WorkerLocation:
        return worker_location(rank)


def test_discovered_placement_matches_the_plan_from_counts(ray_cluster) -> None:
    cluster = discover_cluster(PARALLEL)
    assert [z.name for z in cluster.zones] == ["za", "zb"]
    assert [len(z.hosts) for z in cluster.zones] == [2, 1]
    discovered = build_plan(PARALLEL, cluster, ModelSizes(dense_params=1000))
    counted = build_plan(PARALLEL, ClusterShape(6, 2, 2), ModelSizes(dense_params=1000))
    layout = lambda p: [(s.zone_index, s.host_index, s.local_rank) for s in p.placement.slots]
    assert layout(discovered) == layout(counted) == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 2, 0), (1, 2, 1)
    ]  # fmt: skip
    tiers = lambda p: {k: s.tier for k, s in p.mesh.sets.items()}
    assert tiers(discovered) == tiers(counted)
    assert discovered.mesh[GroupKind.HSDP_SHARD].tier is Tier.NVLINK
    assert discovered.mesh[GroupKind.HSDP_REPLICATE].tier is Tier.CROSS_ZONE
    node_ids = discovered.placement.node_ids()
    assert node_ids[0] == node_ids[1] != node_ids[2] == node_ids[3] != node_ids[4]
    assert [s.zone for s in discovered.placement.slots] == ["za"] * 4 + ["zb"] * 2


def test_pinned_actors_run_where_the_placement_says(ray_cluster) -> None:
    placement = place_on_ray(PARALLEL)
    actors = [
        Probe.options(scheduling_strategy=scheduling_strategy(placement, r)).remote()
        for r in range(placement.world)
    ]
    try:
        reports = ray.get([a.where.remote(r) for r, a in enumerate(actors)])
    finally:
        for a in actors:
            ray.kill(a)
    verify_placement(placement, reports)
    assert [r.zone for r in reports] == ["za"] * 4 + ["zb"] * 2
    assert len({r.node_id for r in reports}) == 3

    # The same reports against a placement that orders the zones the other way: every rank is
    # now somewhere else, and verification says which and where.
    cluster = discover_cluster(PARALLEL)
    swapped = Cluster(zones=tuple(Zone(z.name, z.hosts) for z in reversed(cluster.zones)))
    with pytest.raises(ClusterError) as e:
        verify_placement(swapped.place(6), reports)
    assert "rank 0 should run on node" in e.value.problem and "(zone zb)" in e.value.problem
    with pytest.raises(ClusterError, match="rank 5 did not report"):
        verify_placement(placement, reports[:5])


def test_ray_train_workers_follow_label_selectors(ray_cluster, tmp_path: Path) -> None:
    """A CPU TorchTrainer whose workers are pinned per rank with ScalingConfig(label_selector):
    rank 0 in zone za, rank 1 in zone zb; each worker reports where it ran."""
    from ray.train import RunConfig, ScalingConfig, get_context
    from ray.train.torch import TorchTrainer

    cfg = ParallelConfig(workers=2, gpus_per_host=1)  # one rank per host
    cluster = discover_cluster(cfg)
    one_per_zone = Cluster(zones=tuple(Zone(z.name, z.hosts[:1]) for z in cluster.zones))
    placement = one_per_zone.place(2)
    out = tmp_path / "reports"
    out.mkdir()

    def train_fn(config: dict) -> None:
        import torch.distributed as dist

        rank = get_context().get_world_rank()
        loc = worker_location(rank)
        dist.barrier()  # the gloo process group exists and spans both workers
        Path(config["out"], f"{rank}.json").write_text(json.dumps(loc.__dict__))

    TorchTrainer(
        train_fn,
        train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(
            num_workers=2, use_gpu=False, label_selector=label_selectors(placement)
        ),
        run_config=RunConfig(storage_path=str(tmp_path / "runs"), name="placement"),
    ).fit()
    reports = [WorkerLocation(**json.loads(p.read_text())) for p in sorted(out.glob("*.json"))]
    verify_placement(placement, reports)
    assert [r.zone for r in reports] == ["za", "zb"]
