"""The cluster as zones of hosts of rank slots (GPUs, or CPU workers standing in for them), and
the rank order that keeps each host's ranks contiguous and each zone's hosts contiguous.

Contiguity is what makes the process groups cheap: a block of consecutive ranks then spans as
few hosts and zones as possible, so collectives stay on the fastest network tier they can.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from gem_platform.errors import ClusterError


class Tier(str, Enum):
    """Network tier a collective crosses, cheapest first: NVLink inside a host, the zone's
    RoCE fabric between hosts, the oversubscribed links between zones."""

    NVLINK = "nvlink"
    ZONE = "zone"
    CROSS_ZONE = "cross_zone"

    @property
    def level(self) -> int:
        return _TIER_LEVEL[self]

    @staticmethod
    def widest(tiers: Iterable[Tier]) -> Tier:
        """The most expensive tier among ``tiers`` (NVLink when empty: a 1-rank group)."""
        return max(tiers, key=lambda t: t.level, default=Tier.NVLINK)


_TIER_LEVEL = {Tier.NVLINK: 0, Tier.ZONE: 1, Tier.CROSS_ZONE: 2}


@dataclass(frozen=True)
class Host:
    """One machine: ranks on it talk over NVLink (or shared memory for CPU workers)."""

    name: str
    zone: str
    slots: int
    node_id: str | None = None


@dataclass(frozen=True)
class Zone:
    """Hosts on one non-oversubscribed fabric."""

    name: str
    hosts: tuple[Host, ...]

    @property
    def slots(self) -> int:
        return sum(h.slots for h in self.hosts)


@dataclass(frozen=True)
class RankSlot:
    """Where one global rank runs."""

    rank: int
    zone: str
    host: str
    local_rank: int
    host_index: int
    zone_index: int
    node_id: str | None = None


@dataclass(frozen=True)
class Placement:
    """Global rank -> host/zone, ordered so hosts and zones are contiguous rank ranges."""

    slots: tuple[RankSlot, ...]

    @property
    def world(self) -> int:
        return len(self.slots)

    def __getitem__(self, rank: int) -> RankSlot:
        return self.slots[rank]

    def tier_between(self, a: int, b: int) -> Tier:
        sa, sb = self.slots[a], self.slots[b]
        if sa.host_index == sb.host_index:
            return Tier.NVLINK
        if sa.zone_index == sb.zone_index:
            return Tier.ZONE
        return Tier.CROSS_ZONE

    def tier_of(self, ranks: Sequence[int]) -> Tier:
        """Widest tier spanned by a group of ranks."""
        hosts = {self.slots[r].host_index for r in ranks}
        if len(hosts) <= 1:
            return Tier.NVLINK
        zones = {self.slots[r].zone_index for r in ranks}
        return Tier.ZONE if len(zones) == 1 else Tier.CROSS_ZONE

    def hosts_of(self, ranks: Sequence[int]) -> list[int]:
        """Host indices the group touches, in rank order."""
        return list(dict.fromkeys(self.slots[r].host_index for r in ranks))

    def host_sizes(self) -> list[int]:
        """Ranks placed on each used host, by host index."""
        sizes: dict[int, int] = {}
        for s in self.slots:
            sizes[s.host_index] = sizes.get(s.host_index, 0) + 1
        return [sizes[i] for i in sorted(sizes)]

    @property
    def num_hosts(self) -> int:
        return len({s.host_index for s in self.slots})

    @property
    def num_zones(self) -> int:
        return len({s.zone_index for s in self.slots})

    def node_ids(self) -> list[str | None]:
        """Per-rank node id: the per-worker node assignment handed to Ray."""
        return [s.node_id for s in self.slots]


@dataclass(frozen=True)
class Cluster:
    """Zones of hosts, in placement order (zone by zone, host by host)."""

    zones: tuple[Zone, ...]

    @property
    def hosts(self) -> list[Host]:
        return [h for z in self.zones for h in z.hosts]

    @property
    def capacity(self) -> int:
        return sum(z.slots for z in self.zones)

    @classmethod
    def from_counts(
        cls, num_hosts: int, gpus_per_host: int, hosts_per_zone: int | None = None
    ) -> Cluster:
        """A uniform cluster; the last zone holds the remainder when hosts don't divide."""
        per_zone = hosts_per_zone or num_hosts
        zones = []
        for zi, start in enumerate(range(0, num_hosts, per_zone)):
            zname = f"zone{zi}"
            hosts = tuple(
                Host(name=f"host{h}", zone=zname, slots=gpus_per_host)
                for h in range(start, min(start + per_zone, num_hosts))
            )
            zones.append(Zone(name=zname, hosts=hosts))
        return cls(zones=tuple(zones))

    @classmethod
    def from_hosts(cls, hosts: Iterable[Host]) -> Cluster:
        """Group hosts by zone; zones ordered by name, hosts keep their given order."""
        by_zone: dict[str, list[Host]] = {}
        for h in hosts:
            if h.slots > 0:
                by_zone.setdefault(h.zone, []).append(h)
        return cls(zones=tuple(Zone(z, tuple(by_zone[z])) for z in sorted(by_zone)))

    def place(self, world: int) -> Placement:
        """Assign ranks 0..world-1 host by host, zone by zone (fills each host before the next).

        Raises ClusterError when the cluster has fewer slots than ``world``.
        """
        if world > self.capacity:
            raise ClusterError(
                f"The cluster has {self.capacity} worker slots on {len(self.hosts)} hosts "
                f"in {len(self.zones)} zones; the run needs {world}.",
                "Lower parallel.workers, add nodes, or raise the slots per host "
                "(parallel.gpus_per_host / node resources).",
            )
        slots: list[RankSlot] = []
        host_index = 0
        for zi, zone in enumerate(self.zones):
            for host in zone.hosts:
                if len(slots) == world:
                    break
                for local in range(min(host.slots, world - len(slots))):
                    slots.append(
                        RankSlot(
                            rank=len(slots),
                            zone=zone.name,
                            host=host.name,
                            local_rank=local,
                            host_index=host_index,
                            zone_index=zi,
                            node_id=host.node_id,
                        )
                    )
                host_index += 1
        return Placement(slots=tuple(slots))


@dataclass(frozen=True)
class ClusterShape:
    """A uniform cluster described by counts (what `gemctl plan` takes on the command line)."""

    world: int
    gpus_per_host: int = 1
    hosts_per_zone: int | None = None

    def __post_init__(self) -> None:
        if self.world % self.gpus_per_host != 0:
            raise ClusterError(
                f"world={self.world} is not a whole number of hosts of "
                f"gpus_per_host={self.gpus_per_host}.",
                f"Use a world size that is a multiple of {self.gpus_per_host}.",
            )

    @property
    def num_hosts(self) -> int:
        return self.world // self.gpus_per_host

    def build(self) -> Cluster:
        return Cluster.from_counts(self.num_hosts, self.gpus_per_host, self.hosts_per_zone)
