"""System metrics of every worker host, into the run the driver opened.

The driver samples its own machine under ``system/<metric>`` (provenance.SystemMetrics). On a
Ray run, the first rank placed on each host also samples that host, with MLflow's node id for
system metrics, so the run holds ``system/node_<i>/<metric>`` (CPU, memory, disk, network and,
where there are GPUs, their utilization and memory) for host ``i`` of the placement. The tag
``gem.node.node_<i>`` names the host. MLflow's own MLFLOW_SYSTEM_METRICS_NODE_ID, when set on
a host, overrides the name there (MLflow's rule).

Sampling is best effort: a host whose sampler can't start says why through ``echo`` and
trains on; the run is never failed for want of system metrics.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gem_platform.net import redact

if TYPE_CHECKING:
    from gem_platform.topology import Placement

INTERVAL_ENV = "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"
TAG_PREFIX = "gem.node."


@dataclass(frozen=True)
class NodeMetricsPlan:
    """Which ranks sample their host (rank -> node id) and how often (seconds; None: MLflow's
    default). Built on the driver, sent to every worker."""

    names: dict[int, str] = field(default_factory=dict)
    hosts: dict[str, str] = field(default_factory=dict)  # node id -> host name
    interval_s: float | None = None

    @classmethod
    def from_placement(cls, placement: Placement) -> NodeMetricsPlan:
        """One sampler per host: its first rank, named ``node_<host index>``. The interval is
        the driver's MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL, so the workers follow it."""
        names: dict[int, str] = {}
        hosts: dict[str, str] = {}
        for slot in placement.slots:
            name = f"node_{slot.host_index}"
            if name not in hosts:
                names[slot.rank] = name
                hosts[name] = slot.host
        raw = os.environ.get(INTERVAL_ENV)
        return cls(names, hosts, float(raw) if raw else None)

    def tags(self) -> dict[str, str]:
        """The run's tags naming each node id's host."""
        return {TAG_PREFIX + name: host for name, host in self.hosts.items()}


class NodeSampler:
    """MLflow's SystemMetricsMonitor for this host, logging under ``system/<node_id>/``.

    It continues the run's system-metrics steps (a restarted worker or a resumed run does not
    start again at step 0) and stops by itself when the run is no longer RUNNING."""

    def __init__(self, uri: str, run_id: str, node_id: str,
                 interval_s: float | None = None) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        from gem_platform.tracking import check_reachable

        check_reachable(uri)  # MLflow's sampler would only warn, from its thread
        kwargs: dict[str, Any] = {} if interval_s is None else {"sampling_interval": interval_s}
        self._monitor = SystemMetricsMonitor(run_id, resume_logging=True, node_id=node_id,
                                             tracking_uri=uri, **kwargs)
        self.node_id = self._monitor.node_id
        self._monitor.start()

    def stop(self) -> None:
        """Stop sampling and flush what was sampled."""
        self._monitor.finish()


@contextlib.contextmanager
def sampling_this_host(plan: NodeMetricsPlan | None, rank: int, uri: str, run_id: str,
                       echo: Callable[[str], None]) -> Iterator[NodeSampler | None]:
    """While active, sample this host if ``rank`` is its sampler in ``plan``; else nothing."""
    name = plan.names.get(rank) if plan is not None else None
    sampler = None
    if name is not None:
        try:
            sampler = NodeSampler(uri, run_id, name, plan.interval_s)
        except Exception as err:  # psutil missing, store unreachable: train without them
            echo(f"system metrics of {name} are not recorded: {type(err).__name__}: "
                 f"{redact(str(err))[:200]}")
    try:
        yield sampler
    finally:
        if sampler is not None:
            sampler.stop()
