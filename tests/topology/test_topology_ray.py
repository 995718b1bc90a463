"""Placement on a real (fake multi-node) Ray cluster: discovery by zone label, pinned actors and
Ray Train workers (`gemctl submit` on the cluster puts ranks where `gemctl plan` says, and
records each host's system metrics in the run under its node name), and verification of where
each one really runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

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
    place_on_ray,
    scheduling_strategy,
    verify_placement,
    worker_location,
)
from tests.conftest import gemctl_in_process, run_gemctl
from tests.tiny_training import TINY

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


def test_submit_places_ranks_as_planned_and_records_each_hosts_metrics(
        ray_cluster, mlflow_server, tmp_path: Path) -> None:
    """`gemctl submit --address` on this cluster: three Ray Train workers (one rank per host),
    each pinned by its rank's label selector to a host of its own, two of them on the two
    hosts of zone za and one in zb, where `gemctl plan` puts them; the run records each host's
    system metrics under its node name."""
    (tmp_path / "tiny.yaml").write_text(TINY.format(data=tmp_path / "data"))
    sets = ["--set", "parallel.workers=3", "--set", "parallel.gpus_per_host=1",
            "--set", "parallel.hsdp_shard_group=1", "--set", "train.steps=4",
            "--set", "tracking.experiment=placement"]
    plan = gemctl_in_process("plan", "tiny.yaml", "--world", "3", "--gpus-per-host", "1",
                             "--hosts-per-zone", "2", "--out", "plan.json", *sets,
                             cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-2000:]
    planned = json.loads((tmp_path / "plan.json").read_text())["placement"]

    proc = run_gemctl("submit", "tiny.yaml", "--address", ray_cluster.address, *sets,
                      cwd=tmp_path, env={"MLFLOW_TRACKING_URI": mlflow_server,
                                        "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("placement").experiment_id])
    placement = json.loads(Path(client.download_artifacts(run.info.run_id, "placement.json"))
                           .read_text())
    actual = sorted(placement["actual"], key=lambda loc: loc["rank"])
    assert [loc["zone"] for loc in actual] == ["za", "za", "zb"]
    assert len({loc["node_id"] for loc in actual}) == 3
    # where the selectors pinned them: the discovered placement's node of each rank
    expected = place_on_ray(ParallelConfig(workers=3, gpus_per_host=1))
    verify_placement(expected, [WorkerLocation(**loc) for loc in actual])

    # Same layout as the plan: which ranks share a host and which share a zone.
    def pattern(values: list[str]) -> list[int]:
        order: dict[str, int] = {}
        return [order.setdefault(v, len(order)) for v in values]

    assert pattern([loc["zone"] for loc in actual]) == pattern([s["zone"] for s in planned])
    assert pattern([loc["node_id"] for loc in actual]) == pattern([s["host"] for s in planned])
    assert [s["local_rank"] for s in planned] == [0, 0, 0]
    # one system-metrics sampler per host, each under its node name
    keys, tags = set(run.data.metrics), run.data.tags
    for node in ("node_0", "node_1", "node_2"):
        assert f"system/{node}/cpu_utilization_percentage" in keys, sorted(keys)
        assert f"system/{node}/system_memory_usage_megabytes" in keys
    assert len({tags["gem.node.node_0"], tags["gem.node.node_1"], tags["gem.node.node_2"]}) == 3
    assert not any(k.startswith("system/node_3/") for k in keys)
