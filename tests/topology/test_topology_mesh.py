"""Process groups over a placement: the 4096-GPU example, tier checks, and invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_platform.errors import ClusterError, RecipeError
from gem_platform.topology import (
    Cluster,
    ClusterShape,
    GroupKind,
    Host,
    ParallelConfig,
    Tier,
    resolve_mesh,
)

EXAMPLE = ParallelConfig(
    workers=4096,
    gpus_per_host=8,
    hosts_per_zone=32,
    hsdp_shard_group=128,
    expert_parallel=2,
    expert_shard_hosts=16,
    embedding_group=256,
    embedding_host_split=True,
)


@pytest.fixture(scope="module")
def example_mesh():
    placement = ClusterShape(4096, 8, 32).build().place(4096)
    return resolve_mesh(EXAMPLE, placement)


def test_placement_is_host_and_zone_contiguous() -> None:
    p = ClusterShape(64, 8, 4).build().place(64)
    assert p.num_hosts == 8 and p.num_zones == 2
    assert [s.host_index for s in p.slots] == [r // 8 for r in range(64)]
    assert [s.zone_index for s in p.slots] == [r // 32 for r in range(64)]
    assert [s.local_rank for s in p.slots] == [r % 8 for r in range(64)]
    assert p.tier_between(0, 7) is Tier.NVLINK
    assert p.tier_between(0, 8) is Tier.ZONE
    assert p.tier_between(0, 32) is Tier.CROSS_ZONE


def test_cluster_too_small_is_a_cluster_error() -> None:
    with pytest.raises(ClusterError, match="needs 17"):
        ClusterShape(16, 8).build().place(17)


def test_example_group_shapes_and_tiers(example_mesh) -> None:
    expected = {
        GroupKind.HSDP_SHARD: (32, 128, Tier.ZONE),  # 16 hosts, inside one zone
        GroupKind.HSDP_REPLICATE: (128, 32, Tier.CROSS_ZONE),  # DDP all-reduce across zones
        GroupKind.EXPERT: (2048, 2, Tier.NVLINK),  # 2-way EP inside a host
        GroupKind.EXPERT_SHARD: (256, 16, Tier.ZONE),  # one expert over 16 hosts
        GroupKind.EXPERT_REPLICATE: (32, 128, Tier.CROSS_ZONE),
        GroupKind.EMBEDDING: (16, 256, Tier.ZONE),  # one table copy per zone
        GroupKind.EMBEDDING_REPLICATE: (256, 16, Tier.CROSS_ZONE),
        GroupKind.EMBEDDING_HOST: (512, 8, Tier.NVLINK),
    }
    got = {k: (s.count, s.size, s.tier) for k, s in example_mesh.sets.items()}
    assert got == expected
    assert example_mesh.hsdp_mesh_shape() == (32, 128)


def test_example_groups_hold_the_right_ranks(example_mesh) -> None:
    m = example_mesh
    assert m[GroupKind.HSDP_SHARD].groups[1].ranks == tuple(range(128, 256))
    assert m[GroupKind.HSDP_REPLICATE].groups[5].ranks == tuple(range(5, 4096, 128))
    assert m[GroupKind.EXPERT].groups[3].ranks == (6, 7)
    # expert shard group of local rank 3 on hosts 16..31: rank 3 of each of those hosts
    assert m[GroupKind.EXPERT_SHARD].group_of(16 * 8 + 3).ranks == tuple(
        h * 8 + 3 for h in range(16, 32)
    )
    # every holder of expert 1's shard at block position 0: local ranks 1,3,5,7 of hosts 0,16,..
    rep = m[GroupKind.EXPERT_REPLICATE].group_of(1).ranks
    assert rep == tuple(h * 8 + lr for h in range(0, 512, 16) for lr in (1, 3, 5, 7))
    groups = m.groups_of(300)
    assert 300 in groups[GroupKind.EMBEDDING] and len(groups[GroupKind.EMBEDDING]) == 256
    assert groups[GroupKind.EMBEDDING_HOST] == tuple(range(296, 304))


def test_every_group_kind_partitions_the_world(example_mesh) -> None:
    for kind, gs in example_mesh.sets.items():
        ranks = sorted(r for g in gs.groups for r in g.ranks)
        assert ranks == list(range(4096)), kind


def test_expert_replicas_hold_the_same_shard(example_mesh) -> None:
    """Ranks in one expert replicate group sit at the same position of their expert shard
    group and hold the same expert: that is what makes their gradients summable."""
    m, ep = example_mesh, EXAMPLE.expert_parallel
    for g in m[GroupKind.EXPERT_REPLICATE].groups[:8]:
        positions = {m[GroupKind.EXPERT_SHARD].group_of(r).ranks.index(r) for r in g.ranks}
        experts = {m.placement[r].local_rank % ep for r in g.ranks}
        assert len(positions) == 1 and len(experts) == 1


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"hsdp_shard_group": 512}, r"parallel\.hsdp_shard_group=512 .* span up to 2 zones"),
        ({"hsdp_shard_group": None}, r"hsdp_shard_group \(unset = 4096\) .* 16 zones"),
        ({"expert_shard_hosts": 64}, r"parallel\.expert_shard_hosts=64 .* 2 zones"),
        ({"expert_parallel": 16}, r"parallel\.expert_parallel=16 does not divide"),
        ({"hsdp_shard_group": 12}, r"does not divide parallel\.workers=4096"),
    ],
)
def test_groups_crossing_a_tier_they_must_not_are_errors(update: dict, message: str) -> None:
    placement = ClusterShape(4096, 8, 32).build().place(4096)
    with pytest.raises(RecipeError, match=message) as e:
        resolve_mesh(EXAMPLE.model_copy(update=update), placement)
    assert e.value.fix


def test_cross_zone_fix_suggests_zone_divisors() -> None:
    placement = ClusterShape(4096, 8, 32).build().place(4096)
    with pytest.raises(RecipeError) as e:
        resolve_mesh(EXAMPLE.model_copy(update={"hsdp_shard_group": 1024}), placement)
    assert "divisor of 256" in e.value.fix


def test_group_cutting_hosts_in_two_is_an_error() -> None:
    placement = ClusterShape(48, 8).build().place(48)
    with pytest.raises(RecipeError, match="cut hosts in two"):
        resolve_mesh(ParallelConfig(workers=48, gpus_per_host=8, hsdp_shard_group=12), placement)


def test_embedding_groups_may_cross_zones_but_report_it() -> None:
    placement = ClusterShape(64, 8, 4).build().place(64)
    mesh = resolve_mesh(ParallelConfig(workers=64, gpus_per_host=8, hsdp_shard_group=8), placement)
    assert mesh[GroupKind.EMBEDDING].tier is Tier.CROSS_ZONE
    assert mesh[GroupKind.HSDP_SHARD].tier is Tier.NVLINK
    assert GroupKind.EXPERT not in mesh.sets


def test_host_split_needs_whole_host_embedding_groups() -> None:
    placement = ClusterShape(16, 8).build().place(16)
    cfg = ParallelConfig(workers=16, gpus_per_host=8, embedding_group=4, embedding_host_split=True)
    with pytest.raises(RecipeError, match="embedding_host_split"):
        resolve_mesh(cfg, placement)


def test_expert_parallelism_needs_even_hosts() -> None:
    hosts = [Host("a", "z", 2), Host("b", "z", 1)]
    placement = Cluster.from_hosts(hosts).place(3)
    cfg = ParallelConfig(workers=3, expert_parallel=1, expert_shard_hosts=1)
    with pytest.raises(RecipeError, match="same number of ranks on every host"):
        resolve_mesh(cfg, placement)


def test_default_expert_shard_span_follows_the_dense_shard_group() -> None:
    placement = ClusterShape(64, 8, 4).build().place(64)
    cfg = ParallelConfig(workers=64, gpus_per_host=8, hsdp_shard_group=16, expert_parallel=4)
    mesh = resolve_mesh(cfg, placement)
    assert mesh[GroupKind.EXPERT_SHARD].size == 2  # 16 ranks = 2 hosts
    assert mesh[GroupKind.EXPERT].size == 4 and mesh[GroupKind.EXPERT].tier is Tier.NVLINK


def _pow2_divisors(n: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64) if n % d == 0]


@settings(max_examples=40, deadline=None)
@given(
    per_host=st.sampled_from([1, 2, 4, 8]),
    hosts_per_zone=st.sampled_from([1, 2, 4]),
    zones=st.sampled_from([1, 2, 3]),
    data=st.data(),
)
def test_resolved_groups_partition_world_and_respect_tiers(
    per_host: int, hosts_per_zone: int, zones: int, data
) -> None:
    world = per_host * hosts_per_zone * zones
    zone_ranks = per_host * hosts_per_zone
    shard = data.draw(st.sampled_from(_pow2_divisors(zone_ranks)))
    ep = data.draw(st.sampled_from(_pow2_divisors(per_host)))
    emb = data.draw(st.sampled_from([d for d in _pow2_divisors(world) if d % per_host == 0]))
    cfg = ParallelConfig(
        workers=world,
        gpus_per_host=per_host,
        hsdp_shard_group=shard,
        expert_parallel=ep,
        embedding_group=emb,
    )
    mesh = resolve_mesh(cfg, ClusterShape(world, per_host, hosts_per_zone).build().place(world))
    for gs in mesh.sets.values():
        assert sorted(r for g in gs.groups for r in g.ranks) == list(range(world))
        assert len({len(g.ranks) for g in gs.groups}) == 1
    assert mesh[GroupKind.HSDP_SHARD].tier is not Tier.CROSS_ZONE
    if GroupKind.EXPERT in mesh.sets:
        assert mesh[GroupKind.EXPERT].tier is Tier.NVLINK
        assert mesh[GroupKind.EXPERT_SHARD].tier is not Tier.CROSS_ZONE
    assert mesh.shard_size * mesh.replicate_size == world


@pytest.mark.parametrize("rank", [0, 5, 14])
def test_hsdp_groups_match_torch_device_mesh(rank: int) -> None:
    """FSDP2's 2-D (replicate, shard) DeviceMesh built from hsdp_mesh_shape() gives each rank
    exactly the shard and replicate groups the plan reports."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = ParallelConfig(workers=16, gpus_per_host=4, hosts_per_zone=2, hsdp_shard_group=4)
    mesh = resolve_mesh(cfg, ClusterShape(16, 4, 2).build().place(16))
    dist.init_process_group("fake", rank=rank, world_size=16, store=FakeStore())
    try:
        dm = init_device_mesh("cpu", mesh.hsdp_mesh_shape(), mesh_dim_names=("replicate", "shard"))
        groups = mesh.groups_of(rank)
        assert tuple(dm["shard"].mesh.tolist()) == groups[GroupKind.HSDP_SHARD]
        assert tuple(dm["replicate"].mesh.tolist()) == groups[GroupKind.HSDP_REPLICATE]
    finally:
        dist.destroy_process_group()
