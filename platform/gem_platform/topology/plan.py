"""The plan of a run, computed without running it: where each rank goes, every process group,
which network tier each collective crosses and the bytes per step it moves.

`baselines` price the same model under plain FSDP over all ranks and a global embedding
all_to_all (the first-generation layout), so the plan shows what HSDP and embedding groups save
on the expensive tiers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from gem_platform.topology.cluster import Cluster, ClusterShape, Placement, Tier
from gem_platform.topology.config import ParallelConfig
from gem_platform.topology.costs import (
    Collective,
    ModelSizes,
    embedding_all_to_all,
    embedding_host_split,
    embedding_replica_sync,
    embedding_split_replicate,
    expert_all_to_all,
    fsdp_collectives,
    replicate_all_reduce,
)
from gem_platform.topology.mesh import GroupKind, GroupSet, Mesh, resolve_mesh

COLUMNS = (
    "collective",
    "op",
    "group",
    "groups x ranks",
    "tier",
    "calls/step",
    "payload",
    "sent/rank/step",
)
GROUP_COLUMNS = ("group", "groups x ranks", "tier", "first group")
# Training state per parameter: fp32 weight, fp32 gradient and AdamW's two moments for dense
# and expert weights; fp32 rows and Adagrad's accumulated squares for tables (TorchRec's fused
# optimizer updates them inside the backward and keeps no gradient).
DENSE_STATE_BYTES, TABLE_STATE_BYTES = 16, 8


def human_bytes(n: float) -> str:
    """Binary units, 3 significant digits: 1.50 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Plan:
    """Placement + process groups + communication volume of one parallel configuration."""

    parallel: ParallelConfig
    sizes: ModelSizes
    mesh: Mesh
    collectives: tuple[Collective, ...]
    baselines: tuple[Collective, ...]

    @property
    def placement(self) -> Placement:
        return self.mesh.placement

    def bytes_by_tier(self, collectives: tuple[Collective, ...] | None = None) -> dict[Tier, int]:
        """Bytes one rank sends per step on each tier (a rank takes part in one group of each
        kind, so the per-rank figures add up)."""
        out = {t: 0 for t in Tier}
        for c in self.collectives if collectives is None else collectives:
            out[c.tier] += c.bytes_per_rank
        return out

    def memory_per_rank(self) -> dict[str, int]:
        """Bytes of parameters each rank keeps between steps (sharded state, not activations)."""
        s, m = self.sizes, self.mesh
        experts = _experts_per_rank(self.parallel, s, m)
        expert_bytes = 0
        dense = s.dense_params
        if GroupKind.EXPERT_SHARD in m.sets:
            span = m[GroupKind.EXPERT_SHARD].size
            expert_bytes = experts * s.expert_params * s.param_bytes // span
        else:
            dense += s.num_experts * s.expert_params
        emb = s.embedding_bytes // m[GroupKind.EMBEDDING].size
        if GroupKind.EMBEDDING_SPLIT_REPLICATE in m.sets:  # replicated tables, split per host
            emb = s.embedding_bytes // m[GroupKind.EMBEDDING_HOST].size
        elif GroupKind.EMBEDDING_HOST in m.sets:
            emb //= m[GroupKind.EMBEDDING_HOST].size
        return {
            "dense_params": dense * s.param_bytes // m.shard_size,
            "expert_params": expert_bytes,
            "embedding_tables": emb,
        }

    def training_state_per_rank(self) -> dict[str, int]:
        """Bytes of weights, gradients and optimizer state each rank keeps between steps: what
        the device holds before any activation, so what ``train.activation_memory_gb`` must
        leave room for. ``memory_per_rank`` counts the same parameters at the precision they
        are gathered in."""
        held, per = self.memory_per_rank(), self.sizes.param_bytes
        out = {"dense": held["dense_params"] // per * DENSE_STATE_BYTES,
               "experts": held["expert_params"] // per * DENSE_STATE_BYTES,
               "embedding_tables": held["embedding_tables"] // per * TABLE_STATE_BYTES}
        return out | {"total": sum(out.values())}

    def group_rows(self) -> list[tuple[str, ...]]:
        """One row per kind of process group, for a table (columns: GROUP_COLUMNS)."""
        rows = []
        for kind, gs in self.mesh.sets.items():
            first = gs.groups[0].ranks
            shown = ", ".join(map(str, first[:4])) + (", ..." if len(first) > 4 else "")
            rows.append((kind.value, f"{gs.count} x {gs.size}", gs.tier.value, f"[{shown}]"))
        return rows

    def rows(self) -> list[tuple[str, ...]]:
        """One row per collective, for a table (columns: COLUMNS), then a total per tier."""
        rows = [_row(c) for c in self.collectives]
        for tier, b in self.bytes_by_tier().items():
            rows.append((f"total on {tier.value}", "", "", "", tier.value, "", "", human_bytes(b)))
        return rows

    def baseline_rows(self) -> list[tuple[str, ...]]:
        """The same model with plain FSDP over all ranks and a global embedding all_to_all."""
        return [_row(c) for c in self.baselines]

    def to_dict(self) -> dict[str, Any]:
        p = self.placement
        return {
            "parallel": self.parallel.model_dump(),
            "sizes": asdict(self.sizes),
            "cluster": {
                "world": p.world,
                "hosts": p.num_hosts,
                "zones": p.num_zones,
                "ranks_per_host": self.mesh.ranks_per_host,
            },
            "hsdp_mesh_shape": list(self.mesh.hsdp_mesh_shape()),
            "placement": [
                {
                    "rank": s.rank,
                    "zone": s.zone,
                    "host": s.host,
                    "local_rank": s.local_rank,
                    "node_id": s.node_id,
                }
                for s in p.slots
            ],
            "groups": {
                kind.value: {
                    "size": gs.size,
                    "count": gs.count,
                    "tier": gs.tier.value,
                    "groups": [list(g.ranks) for g in gs.groups],
                }
                for kind, gs in self.mesh.sets.items()
            },
            "collectives": [_collective_dict(c) for c in self.collectives],
            "bytes_per_rank_by_tier": {t.value: b for t, b in self.bytes_by_tier().items()},
            "memory_per_rank": self.memory_per_rank(),
            "training_state_per_rank": self.training_state_per_rank(),
            "baselines": [_collective_dict(c) for c in self.baselines],
            "baseline_bytes_per_rank_by_tier": {
                t.value: b for t, b in self.bytes_by_tier(self.baselines).items()
            },
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _row(c: Collective) -> tuple[str, ...]:
    return (
        c.name,
        c.op,
        c.group,
        f"{c.num_groups} x {c.group_size}",
        c.tier.value,
        str(c.calls_per_step),
        human_bytes(c.payload_bytes),
        human_bytes(c.bytes_per_rank),
    )


def _collective_dict(c: Collective) -> dict[str, Any]:
    return {
        "name": c.name,
        "op": c.op,
        "group": c.group,
        "group_size": c.group_size,
        "num_groups": c.num_groups,
        "tier": c.tier.value,
        "calls_per_step": c.calls_per_step,
        "payload_bytes": c.payload_bytes,
        "bytes_per_rank": c.bytes_per_rank,
        "total_bytes": c.total_bytes,
        "counts": c.counts,
    }


def _experts_per_rank(parallel: ParallelConfig, sizes: ModelSizes, mesh: Mesh) -> int:
    if GroupKind.EXPERT not in mesh.sets:
        return 0
    return max(1, sizes.num_experts // parallel.expert_parallel)


def _collectives(parallel: ParallelConfig, sizes: ModelSizes, mesh: Mesh) -> list[Collective]:
    out: list[Collective] = []
    sets = mesh.sets
    dense = sizes.dense_params
    if GroupKind.EXPERT_SHARD not in sets:
        dense += sizes.num_experts * sizes.expert_params  # experts are plain dense layers then
    shard, rep = sets[GroupKind.HSDP_SHARD], sets[GroupKind.HSDP_REPLICATE]
    out += fsdp_collectives(
        "dense", "hsdp_shard", dense, shard.size, shard.count, shard.tier, sizes
    )
    out.append(
        replicate_all_reduce(
            "dense", "hsdp_replicate", dense, shard.size, rep.size, rep.count, rep.tier, sizes
        )
    )
    if GroupKind.EXPERT_SHARD in sets:
        ep, es, er = (
            sets[GroupKind.EXPERT],
            sets[GroupKind.EXPERT_SHARD],
            sets[GroupKind.EXPERT_REPLICATE],
        )
        out.append(expert_all_to_all(ep.size, ep.count, ep.tier, sizes))
        params = _experts_per_rank(parallel, sizes, mesh) * sizes.expert_params
        out += fsdp_collectives("expert", "expert_shard", params, es.size, es.count, es.tier, sizes)
        out.append(
            replicate_all_reduce(
                "expert", "expert_replicate", params, es.size, er.size, er.count, er.tier, sizes
            )
        )
    if GroupKind.EMBEDDING_SPLIT_REPLICATE in sets:
        return out + _split_replicated(sets, sizes)
    emb, erep = sets[GroupKind.EMBEDDING], sets[GroupKind.EMBEDDING_REPLICATE]
    out.append(embedding_all_to_all(emb.size, emb.count, emb.tier, sizes))
    out.append(embedding_replica_sync(emb.size, erep.size, erep.count, erep.tier, sizes))
    if GroupKind.EMBEDDING_HOST in sets:
        h = sets[GroupKind.EMBEDDING_HOST]
        out += embedding_host_split(emb.size, h.size, h.count, h.tier, sizes)
    return out


def _split_replicated(sets: dict[GroupKind, GroupSet], sizes: ModelSizes) -> list[Collective]:
    """Replicated tables split over each host (what training runs for embedding_host_split
    without a layout or embedding group): no embedding all_to_all; the whole tables are
    all-gathered and their gradients reduce-scattered inside the host, and each piece's
    gradient is all-reduced across hosts."""
    h, rep = sets[GroupKind.EMBEDDING_HOST], sets[GroupKind.EMBEDDING_SPLIT_REPLICATE]
    return [*embedding_host_split(1, h.size, h.count, h.tier, sizes),
            embedding_split_replicate(h.size, rep.size, rep.count, rep.tier, sizes)]


def _baselines(sizes: ModelSizes, placement: Placement) -> list[Collective]:
    """Plain FSDP over every rank (experts included) and one global embedding all_to_all."""
    world = placement.world
    tier = placement.tier_of(range(world))
    dense = sizes.dense_params + sizes.num_experts * sizes.expert_params
    out = fsdp_collectives("plain FSDP", "world", dense, world, 1, tier, sizes)
    out.append(embedding_all_to_all(world, 1, tier, sizes, group_name="world"))
    return out


def build_plan(
    parallel: ParallelConfig, cluster: ClusterShape | Cluster, sizes: ModelSizes
) -> Plan:
    """Place ranks, resolve every process group and price every collective.

    With a ClusterShape (counts from the command line) the shape wins: the world size, ranks
    per host and hosts per zone of ``parallel`` are replaced by the shape's. With a Cluster
    (e.g. discovered from Ray) ``parallel.workers`` ranks are placed on it.
    Raises RecipeError for sizes that don't divide or groups crossing a tier they must not,
    ClusterError when the cluster is too small.
    """
    if isinstance(cluster, ClusterShape):
        parallel = parallel.model_copy(
            update={
                "workers": cluster.world,
                "gpus_per_host": cluster.gpus_per_host,
                "hosts_per_zone": cluster.hosts_per_zone,
            }
        )
        cluster = cluster.build()
    placement = cluster.place(parallel.workers)
    mesh = resolve_mesh(parallel, placement)
    return Plan(
        parallel=parallel,
        sizes=sizes,
        mesh=mesh,
        collectives=tuple(_collectives(parallel, sizes, mesh)),
        baselines=tuple(_baselines(sizes, placement)),
    )
