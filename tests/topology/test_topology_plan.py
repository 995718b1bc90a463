"""Plans: bytes per collective from model sizes, tiers, JSON and table rows."""

from __future__ import annotations

import json

import pytest

from gem_platform.errors import RecipeError
from gem_platform.topology import ClusterShape, ModelSizes, ParallelConfig, Tier, build_plan
from gem_platform.topology.costs import (
    all_to_all_bytes,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
)
from gem_platform.topology.plan import COLUMNS, GROUP_COLUMNS, human_bytes

GiB = 1024**3

# Illustrative GEM-scale sizes: 2B dense params, 2 experts of 1B, 1T bf16 embedding params,
# 256 KiB of pooled embeddings and 64 KiB of expert input per sample, 1024 samples per GPU.
EXAMPLE_SIZES = ModelSizes(
    dense_params=2_000_000_000,
    expert_params=1_000_000_000,
    num_experts=2,
    embedding_table_bytes=(10**12, 10**12),
    pooled_embedding_bytes_per_sample=256 * 1024,
    expert_activation_bytes_per_sample=64 * 1024,
    local_batch=1024,
)
EXAMPLE = ParallelConfig(
    hsdp_shard_group=128,
    expert_parallel=2,
    expert_shard_hosts=16,
    embedding_group=256,
    embedding_host_split=True,
)


@pytest.fixture(scope="module")
def example_plan():
    return build_plan(EXAMPLE, ClusterShape(4096, 8, 32), EXAMPLE_SIZES)


def _by_name(plan):
    return {c.name: c for c in plan.collectives}


def test_ring_formulas() -> None:
    assert ring_all_gather_bytes(1000, 4) == 750
    assert ring_all_reduce_bytes(1000, 4) == 1500
    assert all_to_all_bytes(1000, 2) == 500
    assert ring_all_gather_bytes(1000, 1) == 0 and all_to_all_bytes(1000, 1) == 0


def test_small_plan_bytes_by_hand() -> None:
    """4 ranks = 2 hosts x 2; shard group 2 (one host), 2 replicas; embeddings over all 4."""
    sizes = ModelSizes(
        dense_params=1000, pooled_embedding_bytes_per_sample=100, local_batch=10, grad_bytes=4
    )
    plan = build_plan(ParallelConfig(hsdp_shard_group=2), ClusterShape(4, 2), sizes)
    c = _by_name(plan)
    ag = c["dense param all-gather"]
    assert (ag.payload_bytes, ag.calls_per_step, ag.bytes_per_rank) == (2000, 2, 2000)
    assert ag.tier is Tier.NVLINK and ag.num_groups == 2 and ag.group_size == 2
    rs = c["dense grad reduce-scatter"]
    assert (rs.payload_bytes, rs.bytes_per_rank) == (4000, 2000)
    ar = c["dense grad all-reduce"]  # 1/2 of the grads, across 2 replicas on different hosts
    assert (ar.payload_bytes, ar.bytes_per_rank, ar.tier) == (2000, 2000, Tier.ZONE)
    emb = c["embedding pooled all_to_all"]  # 10 x 100 B, 3/4 leaves, fwd + bwd
    assert (emb.payload_bytes, emb.bytes_per_rank, emb.tier) == (1000, 1500, Tier.ZONE)
    assert plan.bytes_by_tier() == {Tier.NVLINK: 4000, Tier.ZONE: 3500, Tier.CROSS_ZONE: 0}


def test_ddp_like_and_plain_fsdp_extremes() -> None:
    sizes = ModelSizes(dense_params=1000)
    ddp = _by_name(build_plan(ParallelConfig(hsdp_shard_group=1), ClusterShape(4, 2), sizes))
    assert ddp["dense param all-gather"].bytes_per_rank == 0
    assert ddp["dense grad all-reduce"].bytes_per_rank == round(2 * 4000 * 3 / 4)
    fsdp = _by_name(build_plan(ParallelConfig(), ClusterShape(4, 2), sizes))
    assert fsdp["dense grad all-reduce"].bytes_per_rank == 0
    assert fsdp["dense param all-gather"].bytes_per_rank == round(2 * 2000 * 3 / 4)


def test_example_plan_tiers(example_plan) -> None:
    tiers = {c.name: c.tier for c in example_plan.collectives}
    assert tiers == {
        "dense param all-gather": Tier.ZONE,
        "dense grad reduce-scatter": Tier.ZONE,
        "dense grad all-reduce": Tier.CROSS_ZONE,
        "expert activation all_to_all": Tier.NVLINK,
        "expert param all-gather": Tier.ZONE,
        "expert grad reduce-scatter": Tier.ZONE,
        "expert grad all-reduce": Tier.CROSS_ZONE,
        "embedding pooled all_to_all": Tier.ZONE,
        "embedding replica row sync": Tier.CROSS_ZONE,
        "embedding shard all-gather": Tier.NVLINK,
        "embedding shard reduce-scatter": Tier.NVLINK,
    }


def test_example_plan_numbers(example_plan) -> None:
    c = _by_name(example_plan)
    # dense: 2e9 bf16 params gathered twice over 128 ranks; grads fp32 all-reduced across 32
    assert c["dense param all-gather"].bytes_per_rank == round(2 * 4e9 * 127 / 128)
    assert c["dense grad all-reduce"].payload_bytes == round(8e9 / 128)
    assert c["dense grad all-reduce"].bytes_per_rank == round(2 * 8e9 / 128 * 31 / 32)
    # one expert per GPU, sharded 16 ways; activations to the partner GPU, 4 passes
    assert c["expert param all-gather"].bytes_per_rank == round(2 * 2e9 * 15 / 16)
    assert c["expert activation all_to_all"].bytes_per_rank == 4 * 1024 * 64 * 1024
    # pooled embeddings within 256 ranks; the rank's 1/256 of 2 TB split over 8 GPUs
    assert c["embedding pooled all_to_all"].bytes_per_rank == round(2 * 2**28 * 255 / 256)
    assert c["embedding shard all-gather"].payload_bytes == round(2e12 / 256)
    mem = example_plan.memory_per_rank()
    assert mem["embedding_tables"] == 2 * 10**12 // 256 // 8
    assert mem["dense_params"] == 4 * 10**9 // 128
    # what training keeps: 16 bytes a dense parameter (fp32 weight, gradient, AdamW's two
    # moments), 8 a table element (fp32 row, Adagrad's squares), out of 2-byte gathered ones
    state = example_plan.training_state_per_rank()
    assert state["dense"] == 4 * 10**9 // 128 // 2 * 16
    assert state["embedding_tables"] == mem["embedding_tables"] // 2 * 8
    assert state["total"] == state["dense"] + state["experts"] + state["embedding_tables"]


def test_hsdp_moves_cross_zone_traffic_off_the_dense_path(example_plan) -> None:
    """The point of HSDP + embedding groups: what crosses zones per rank per step shrinks
    from the whole FSDP + global all_to_all volume to the gradient all-reduces."""
    ours = example_plan.bytes_by_tier()[Tier.CROSS_ZONE]
    base = example_plan.bytes_by_tier(example_plan.baselines)[Tier.CROSS_ZONE]
    assert base > 20 * ours
    assert {c.tier for c in example_plan.baselines} == {Tier.CROSS_ZONE}
    assert ours < 1.2 * GiB < 30 * GiB < base


def test_shape_overrides_the_recipe_world() -> None:
    cfg = ParallelConfig(workers=2, hsdp_shard_group=8)
    plan = build_plan(cfg, ClusterShape(16, 8, 1), ModelSizes(10))
    assert plan.placement.world == 16 and plan.parallel.workers == 16
    assert plan.placement.num_zones == 2


def test_plan_errors_are_recipe_errors() -> None:
    with pytest.raises(RecipeError, match="hsdp_shard_group=3"):
        build_plan(ParallelConfig(hsdp_shard_group=3), ClusterShape(4, 2), ModelSizes(10))


def test_json_round_trip(example_plan) -> None:
    d = json.loads(example_plan.to_json())
    assert d["cluster"] == {"world": 4096, "hosts": 512, "zones": 16, "ranks_per_host": 8}
    assert d["hsdp_mesh_shape"] == [32, 128]
    assert d["groups"]["hsdp_shard"]["tier"] == "zone"
    assert d["groups"]["hsdp_replicate"]["groups"][0][:3] == [0, 128, 256]
    assert len(d["placement"]) == 4096 and d["placement"][4095]["zone"] == "zone15"
    assert d["parallel"]["hsdp_shard_group"] == 128
    assert set(d["bytes_per_rank_by_tier"]) == {"nvlink", "zone", "cross_zone"}
    assert all(c["total_bytes"] >= c["bytes_per_rank"] for c in d["collectives"])


def test_rows_fit_the_columns(example_plan) -> None:
    rows = example_plan.rows()
    assert all(len(r) == len(COLUMNS) for r in rows)
    assert rows[-1][0] == "total on cross_zone"
    assert all(len(r) == len(GROUP_COLUMNS) for r in example_plan.group_rows())
    assert [r[0] for r in example_plan.group_rows()][:2] == ["hsdp_shard", "hsdp_replicate"]
    assert all(len(r) == len(COLUMNS) for r in example_plan.baseline_rows())


def test_human_bytes() -> None:
    assert human_bytes(512) == "512 B"
    assert human_bytes(1.5 * GiB) == "1.5 GiB"
