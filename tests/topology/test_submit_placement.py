"""`gemctl submit` on a fake two-zone Ray cluster puts ranks where `gemctl plan` says, and
records each host's system metrics in the run under its node name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import gemctl_in_process, run_gemctl
from tests.tiny_training import TINY


@pytest.fixture(scope="module")
def two_zone_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "labels": {"gem.zone": "za"}})
    cluster.add_node(num_cpus=1, labels={"gem.zone": "zb"})
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.mark.slow
def test_submit_places_ranks_as_planned_and_records_each_hosts_metrics(
        two_zone_cluster, mlflow_server, tmp_path: Path):
    (tmp_path / "tiny.yaml").write_text(TINY.format(data=tmp_path / "data"))
    sets = ["--set", "parallel.gpus_per_host=1", "--set", "parallel.hsdp_shard_group=1",
            "--set", "train.steps=4",
            "--set", "tracking.experiment=placement"]
    plan = gemctl_in_process("plan", "tiny.yaml", "--world", "2", "--gpus-per-host", "1",
                             "--hosts-per-zone", "1", "--out", "plan.json", *sets,
                             cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-2000:]
    planned = json.loads((tmp_path / "plan.json").read_text())["placement"]

    proc = run_gemctl("submit", "tiny.yaml", "--address", two_zone_cluster.address, *sets,
                      cwd=tmp_path, env={"MLFLOW_TRACKING_URI": mlflow_server,
                                        "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("placement").experiment_id])
    placement = json.loads(Path(client.download_artifacts(run.info.run_id, "placement.json"))
                           .read_text())
    actual = sorted(placement["actual"], key=lambda loc: loc["rank"])
    assert [loc["zone"] for loc in actual] == ["za", "zb"]
    assert len({loc["node_id"] for loc in actual}) == 2
    # Same layout as the plan: which ranks share a host and which share a zone.
    def pattern(values: list[str]) -> list[int]:
        order: dict[str, int] = {}
        return [order.setdefault(v, len(order)) for v in values]

    assert pattern([loc["zone"] for loc in actual]) == pattern([s["zone"] for s in planned])
    assert pattern([loc["node_id"] for loc in actual]) == pattern([s["host"] for s in planned])
    assert [s["local_rank"] for s in planned] == [0, 0]
    # one system-metrics sampler per host, each under its node name
    keys, tags = set(run.data.metrics), run.data.tags
    for node in ("node_0", "node_1"):
        assert f"system/{node}/cpu_utilization_percentage" in keys, sorted(keys)
        assert f"system/{node}/system_memory_usage_megabytes" in keys
    assert tags["gem.node.node_0"] != tags["gem.node.node_1"]
    assert not any(k.startswith("system/node_2/") for k in keys)
