"""System metrics of every worker host land in the run, named by MLflow's node id (a real
three-host Ray run checks it in tests/topology/test_topology_ray.py)."""

from __future__ import annotations

import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from gem_platform.node_metrics import NodeMetricsPlan, NodeSampler, sampling_this_host
from gem_platform.topology.cluster import Cluster, Host
from gem_platform.tracking import RunTracker


def test_one_sampler_per_host_named_by_host_index(monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    placement = Cluster.from_hosts([Host("10.0.0.1/aa", "za", 2), Host("10.0.0.2/bb", "za", 2),
                                    Host("10.0.0.3/cc", "zb", 1)]).place(5)
    plan = NodeMetricsPlan.from_placement(placement)
    assert plan.names == {0: "node_0", 2: "node_1", 4: "node_2"}
    assert plan.tags() == {"gem.node.node_0": "10.0.0.1/aa", "gem.node.node_1": "10.0.0.2/bb",
                           "gem.node.node_2": "10.0.0.3/cc"}
    assert plan.interval_s == 0.5


def _wait_for(client: MlflowClient, run_id: str, prefixes: list[str], timeout: float = 60):
    deadline = time.time() + timeout
    while True:
        keys = set(client.get_run(run_id).data.metrics)
        if all(any(k.startswith(p) for k in keys) for p in prefixes) or time.time() > deadline:
            return keys
        time.sleep(0.2)


def test_two_samplers_log_into_one_run_each_under_its_node(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = RunTracker.start(uri, "nodes", None, {"a": 1})
    plan = NodeMetricsPlan({0: "node_0", 1: "node_1"}, {}, interval_s=0.2)
    lines: list[str] = []
    with sampling_this_host(plan, 0, uri, tracker.run_id, lines.append) as first, \
            sampling_this_host(plan, 1, uri, tracker.run_id, lines.append) as second, \
            sampling_this_host(plan, 2, uri, tracker.run_id, lines.append) as none:
        assert isinstance(first, NodeSampler) and isinstance(second, NodeSampler)
        assert none is None  # rank 2 is not its host's sampler
        keys = _wait_for(MlflowClient(uri), tracker.run_id,
                         ["system/node_0/cpu_utilization", "system/node_1/system_memory"])
    tracker.finish(ok=True)
    assert not lines
    for node in ("node_0", "node_1"):
        assert f"system/{node}/cpu_utilization_percentage" in keys
        assert f"system/{node}/system_memory_usage_megabytes" in keys


def test_a_sampler_that_cannot_start_is_reported_and_training_goes_on(tmp_path: Path):
    plan = NodeMetricsPlan({0: "node_0"}, {}, interval_s=0.2)
    lines: list[str] = []
    uri = "sqlite:///" + str(tmp_path / "missing-folder" / "mlflow.db")
    with sampling_this_host(plan, 0, uri, "0" * 32, lines.append) as sampler:
        assert sampler is None
    assert len(lines) == 1 and lines[0].startswith("system metrics of node_0 are not recorded")
