"""Process groups and DeviceMeshes of one rank, built from the topology's group lists.

The topology (``gem_platform.topology.resolve_mesh``) decides which ranks form each group; this
module only turns those rank lists into live ``torch.distributed`` groups. Creating a group is
collective over the whole world, so every rank creates every group of every kind, in the same
order, and keeps the one it belongs to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from gem_platform.topology import ClusterShape, GroupKind, Mesh, ParallelConfig, resolve_mesh


def _ranks_per_host(parallel: ParallelConfig, world: int) -> int:
    """Ranks per host as the recipe states them; GPU workers without a stated size use the
    launcher's LOCAL_WORLD_SIZE (Ray Train and torchrun set it)."""
    per_host = parallel.ranks_per_host()
    if per_host is None:
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return per_host if world % per_host == 0 else 1


def topology_mesh(parallel: ParallelConfig, world: int) -> Mesh:
    """The topology's groups for ``world`` ranks placed host by host, zone by zone (the order
    the launcher numbers workers in)."""
    shape = ClusterShape(world, _ranks_per_host(parallel, world), parallel.hosts_per_zone)
    return resolve_mesh(parallel, shape.build().place(world))


@dataclass(frozen=True)
class RankGroups:
    """This rank's live process group of each kind the topology defines."""

    rank: int
    world: int
    mesh: Mesh
    groups: dict[GroupKind, dist.ProcessGroup]

    def ranks(self, kind: GroupKind) -> tuple[int, ...]:
        """Global ranks of this rank's group of ``kind``."""
        return self.mesh[kind].group_of(self.rank).ranks

    def group(self, kind: GroupKind) -> dist.ProcessGroup:
        return self.groups[kind]

    def has(self, kind: GroupKind) -> bool:
        return kind in self.groups


def build_rank_groups(parallel: ParallelConfig) -> RankGroups:
    """Create every process group of the topology (collective: all ranks must call it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = topology_mesh(parallel, world)
    groups: dict[GroupKind, dist.ProcessGroup] = {}
    for kind, group_set in mesh.sets.items():
        lists = [list(g.ranks) for g in group_set.groups]
        if group_set.size == world:
            groups[kind] = dist.group.WORLD
            continue
        mine, _ = dist.new_subgroups_by_enumeration(lists)
        groups[kind] = mine
    return RankGroups(rank, world, mesh, groups)


def hsdp_device_mesh(groups: RankGroups, device_type: str) -> DeviceMesh:
    """The dense (replicate, shard) mesh: row i is shard group i, so the replicate groups are
    its columns, exactly as the topology lays them out."""
    replicate, shard = groups.mesh.hsdp_mesh_shape()
    layout = torch.arange(groups.world).view(replicate, shard)
    return _mesh_2d(groups, GroupKind.HSDP_REPLICATE, GroupKind.HSDP_SHARD, layout, device_type)


def expert_device_mesh(groups: RankGroups, device_type: str) -> DeviceMesh:
    """The (replicate, shard) mesh of the experts this rank holds: each column is an expert
    replicate group, each row an expert shard group (both taken from the topology)."""
    shard_set = groups.mesh[GroupKind.EXPERT_SHARD]
    rows = [shard_set.group_of(r).ranks for r in groups.ranks(GroupKind.EXPERT_REPLICATE)]
    layout = torch.tensor(rows)
    return _mesh_2d(groups, GroupKind.EXPERT_REPLICATE, GroupKind.EXPERT_SHARD, layout, device_type)


def _mesh_2d(groups: RankGroups, replicate: GroupKind, shard: GroupKind,
             layout: torch.Tensor, device_type: str) -> DeviceMesh:
    """A 2-D DeviceMesh over existing groups; checks that this rank's row and column of
    ``layout`` are its shard and replicate groups."""
    row, col = (layout == groups.rank).nonzero()[0].tolist()
    if (tuple(layout[row].tolist()) != groups.ranks(shard)
            or tuple(layout[:, col].tolist()) != groups.ranks(replicate)):
        raise RuntimeError(
            f"rank {groups.rank}: {shard.value}/{replicate.value} groups do not form a grid "
            f"({layout.tolist()})")
    return DeviceMesh.from_group(
        [groups.group(replicate), groups.group(shard)], device_type, mesh=layout,
        mesh_dim_names=("replicate", "shard"))
