"""Resolve the recipe's parallel sizes into process groups over a concrete placement.

Every group is a list of global ranks plus the widest network tier it spans. Groups are blocks
of consecutive ranks (or strides across such blocks), so with host- and zone-contiguous ranks a
block of 128 GPUs stays inside one zone and a block of 2 inside one host. Sizes that don't
divide raise RecipeError; groups that would cross a tier they must not cross (expert exchange
leaving a host, FSDP leaving a zone, a group cutting a host in two) raise RecipeError too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from gem_platform.errors import RecipeError
from gem_platform.topology.cluster import Placement, Tier
from gem_platform.topology.config import ParallelConfig, divisors


class GroupKind(str, Enum):
    """What a set of process groups is for."""

    HSDP_SHARD = "hsdp_shard"  # FSDP all-gather / reduce-scatter of dense parameters
    HSDP_REPLICATE = "hsdp_replicate"  # all-reduce of dense gradient shards across replicas
    EXPERT = "expert"  # all_to_all of activations between the experts of one host
    EXPERT_SHARD = "expert_shard"  # FSDP of one expert's parameters over hosts
    EXPERT_REPLICATE = "expert_replicate"  # all-reduce of expert gradient shards
    EMBEDDING = "embedding"  # all_to_all of pooled embeddings; one table copy per group
    EMBEDDING_REPLICATE = "embedding_replicate"  # data-parallel sync across table copies
    EMBEDDING_HOST = "embedding_host"  # intra-host all-gather/reduce-scatter of a rank's shard
    # all-reduce across hosts of the host-split pieces of replicated tables
    EMBEDDING_SPLIT_REPLICATE = "embedding_split_replicate"


@dataclass(frozen=True)
class ProcessGroup:
    kind: GroupKind
    ranks: tuple[int, ...]
    tier: Tier


@dataclass(frozen=True)
class GroupSet:
    """All groups of one kind; they partition the world and have equal size."""

    kind: GroupKind
    groups: tuple[ProcessGroup, ...]

    @property
    def size(self) -> int:
        return len(self.groups[0].ranks)

    @property
    def count(self) -> int:
        return len(self.groups)

    @property
    def tier(self) -> Tier:
        return Tier.widest(g.tier for g in self.groups)

    @cached_property
    def _by_rank(self) -> dict[int, ProcessGroup]:
        return {r: g for g in self.groups for r in g.ranks}

    def group_of(self, rank: int) -> ProcessGroup:
        """The group of this kind that ``rank`` belongs to."""
        return self._by_rank[rank]


@dataclass(frozen=True)
class Mesh:
    """Process groups of every parallel dimension over one placement."""

    placement: Placement
    sets: dict[GroupKind, GroupSet]
    shard_size: int
    replicate_size: int
    ranks_per_host: int | None

    def __getitem__(self, kind: GroupKind) -> GroupSet:
        return self.sets[kind]

    def hsdp_mesh_shape(self) -> tuple[int, int]:
        """(replicate, shard): the 2-D DeviceMesh for FSDP2 HSDP over ranks 0..world-1 in
        row-major order (row i = shard group i)."""
        return (self.replicate_size, self.shard_size)

    def groups_of(self, rank: int) -> dict[GroupKind, tuple[int, ...]]:
        """The ranks each group of ``rank`` holds: what one worker needs to build its groups."""
        return {k: s.group_of(rank).ranks for k, s in self.sets.items()}


def _field(parallel: ParallelConfig, name: str, world: int) -> str:
    value = getattr(parallel, name)
    return f"parallel.{name}={value}" if value is not None else f"parallel.{name} (unset = {world})"


def _make(kind: GroupKind, groups: Sequence[Sequence[int]], placement: Placement) -> GroupSet:
    return GroupSet(
        kind,
        tuple(ProcessGroup(kind, tuple(g), placement.tier_of(g)) for g in groups),
    )


def _blocks(world: int, size: int) -> list[list[int]]:
    return [list(range(s, s + size)) for s in range(0, world, size)]


def _strides(world: int, size: int) -> list[list[int]]:
    """Rank j of every block of ``size``: the replicas of one shard."""
    return [list(range(j, world, size)) for j in range(size)]


def _uniform_host_size(placement: Placement) -> int | None:
    sizes = set(placement.host_sizes())
    return sizes.pop() if len(sizes) == 1 else None


def _check_whole_hosts(
    groups: GroupSet, placement: Placement, field: str, per_host: int | None
) -> None:
    """A group spanning several hosts must hold all ranks of each: half a host in one group
    and half in another puts NVLink neighbours into different collectives for no gain."""
    sizes = placement.host_sizes()
    for g in groups.groups:
        hosts = placement.hosts_of(g.ranks)
        if len(hosts) > 1 and sum(sizes[h] for h in hosts) != len(g.ranks):
            hint = f"a multiple or divisor of {per_host}" if per_host else "whole hosts"
            raise RecipeError(
                f"{field} makes group {_short(g.ranks)} cut hosts in two "
                f"(it spans {len(hosts)} hosts but not all of their ranks).",
                f"Choose a size that is {hint} (the ranks per host).",
            )


def _zone_ranks(placement: Placement) -> int:
    counts: dict[int, int] = {}
    for s in placement.slots:
        counts[s.zone_index] = counts.get(s.zone_index, 0) + 1
    return min(counts.values())


def _short(ranks: Sequence[int]) -> str:
    if len(ranks) <= 6:
        return "[" + ", ".join(map(str, ranks)) + "]"
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def _forbid_cross_zone(
    groups: GroupSet, placement: Placement, field: str, what: str, unit: str = "ranks"
) -> None:
    if groups.tier is not Tier.CROSS_ZONE:
        return
    zone_ranks = _zone_ranks(placement)
    per_host = _uniform_host_size(placement)
    zone_units = zone_ranks // per_host if (unit == "hosts" and per_host) else zone_ranks
    spanned = max(len({placement[r].zone_index for r in g.ranks}) for g in groups.groups)
    raise RecipeError(
        f"{field} makes {what} groups span up to {spanned} zones "
        f"({zone_units} {unit} per zone): its collectives would run every step over the "
        "oversubscribed cross-zone links.",
        f"Choose a divisor of {zone_units} ({', '.join(map(str, divisors(zone_units)))}) so "
        "each group stays inside a zone; only data-parallel all-reduce should cross zones.",
    )


def resolve_mesh(parallel: ParallelConfig, placement: Placement) -> Mesh:
    """Build every process group of ``parallel`` over ``placement``.

    Raises RecipeError naming the field when a size does not divide (world, ranks per host,
    host count) or a group would cross a tier it must not: expert groups leave a host, FSDP
    shard or expert shard groups leave a zone, or any multi-host group cuts a host in two.
    """
    world = placement.world
    per_host = _uniform_host_size(placement)
    parallel.validate_world(world)
    if per_host is not None:
        parallel.validate_hosts(world, per_host)
    sets: dict[GroupKind, GroupSet] = {}

    shard = parallel.shard_size(world)
    replicate = world // shard
    sets[GroupKind.HSDP_SHARD] = _make(GroupKind.HSDP_SHARD, _blocks(world, shard), placement)
    sets[GroupKind.HSDP_REPLICATE] = _make(
        GroupKind.HSDP_REPLICATE, _strides(world, shard), placement
    )
    shard_field = _field(parallel, "hsdp_shard_group", world)
    _check_whole_hosts(sets[GroupKind.HSDP_SHARD], placement, shard_field, per_host)
    _forbid_cross_zone(sets[GroupKind.HSDP_SHARD], placement, shard_field, "FSDP shard")

    if parallel.expert_parallel > 1 or parallel.expert_shard_hosts is not None:
        sets.update(_expert_sets(parallel, placement, per_host, shard))

    emb = parallel.embedding_size(world)
    sets[GroupKind.EMBEDDING] = _make(GroupKind.EMBEDDING, _blocks(world, emb), placement)
    sets[GroupKind.EMBEDDING_REPLICATE] = _make(
        GroupKind.EMBEDDING_REPLICATE, _strides(world, emb), placement
    )
    emb_field = _field(parallel, "embedding_group", world)
    _check_whole_hosts(sets[GroupKind.EMBEDDING], placement, emb_field, per_host)
    if parallel.embedding_host_split:
        if per_host is None or emb % per_host != 0:
            raise RecipeError(
                f"parallel.embedding_host_split needs each embedding group to hold whole hosts; "
                f"{emb_field} and {per_host or 'uneven'} ranks per host don't allow it.",
                "Set parallel.embedding_group to a multiple of the ranks per host, or turn "
                "embedding_host_split off.",
            )
        sets[GroupKind.EMBEDDING_HOST] = _make(
            GroupKind.EMBEDDING_HOST, _blocks(world, per_host), placement
        )
        if parallel.tables_replicated():
            sets[GroupKind.EMBEDDING_SPLIT_REPLICATE] = _make(
                GroupKind.EMBEDDING_SPLIT_REPLICATE, _strides(world, per_host), placement
            )
    return Mesh(placement, sets, shard, replicate, per_host)


def _expert_sets(
    parallel: ParallelConfig, placement: Placement, per_host: int | None, shard: int
) -> dict[GroupKind, GroupSet]:
    """Expert parallelism inside a host; each expert's parameters sharded over hosts.

    Local rank l = k * EP + e holds expert e of the k-th expert group of its host. The expert
    shard group of (host block b, local rank l) is rank l of every host in block b; the expert
    replicate group of (expert e, host position p in its block) gathers every holder of that
    same shard: all k on every block.
    """
    ep = parallel.expert_parallel
    world = placement.world
    if per_host is None:
        raise RecipeError(
            f"parallel.expert_parallel={ep} needs the same number of ranks on every host; "
            f"the placement has {placement.host_sizes()} ranks per host.",
            "Give every node the same worker slots, or set parallel.workers to fill whole hosts.",
        )
    hosts = world // per_host
    span = parallel.expert_shard_hosts
    if span is None:
        span = max(1, shard // per_host)
    if hosts % span != 0:
        raise RecipeError(
            f"parallel.expert_shard_hosts={span} does not divide the host count ({hosts}).",
            f"Choose a divisor of {hosts} ({', '.join(map(str, divisors(hosts)))}).",
        )
    ep_set = _make(GroupKind.EXPERT, _blocks(world, ep), placement)

    shard_groups = [
        [h * per_host + local for h in range(b, b + span)]
        for b in range(0, hosts, span)
        for local in range(per_host)
    ]
    shard_set = _make(GroupKind.EXPERT_SHARD, shard_groups, placement)
    field = f"parallel.expert_shard_hosts={span}"
    _forbid_cross_zone(shard_set, placement, field, "expert shard", unit="hosts")

    replicate_groups = [
        [h * per_host + k * ep + e for h in range(p, hosts, span) for k in range(per_host // ep)]
        for e in range(ep)
        for p in range(span)
    ]
    return {
        GroupKind.EXPERT: ep_set,
        GroupKind.EXPERT_SHARD: shard_set,
        GroupKind.EXPERT_REPLICATE: _make(GroupKind.EXPERT_REPLICATE, replicate_groups, placement),
    }
