"""HSDP on a 2x2 (replicate x shard) mesh of 4 gloo processes trains like one process on the
global batch; so do the replicate-only (4x1) mesh and the layout of recipes/hsdp_cpu.yaml
(HSDP + expert parallelism + row-wise sharded tables on 2 stand-in hosts of 2 ranks)."""

from __future__ import annotations

import functools

import pytest

from tests.parallel.harness import reference_losses, run_recipes, spawn, tiny_recipe

WORLD = 4
RECIPES = {
    "hsdp_2x2": tiny_recipe(workers=WORLD, hsdp_shard_group=2),
    "replicate_only": tiny_recipe(workers=WORLD, hsdp_shard_group=1),
    "all": tiny_recipe(workers=WORLD, gpus_per_host=2, hsdp_shard_group=2, expert_parallel=2,
                       embedding_sharding="row_wise"),
}
STRATEGIES = {"hsdp_2x2": "hsdp", "replicate_only": "hsdp",
              "all": "hsdp+expert_parallel+torchrec_sharding"}
# dense (replicate, shard) mesh; experts: each held by the same position of both hosts
MESHES = {"hsdp_2x2": {(2, 2)}, "replicate_only": {(4, 1)}, "all": {(2, 2), (2, 1)}}


@pytest.mark.slow
def test_hsdp_matches_single_process():
    results = spawn(functools.partial(run_recipes, RECIPES), WORLD)
    expected = reference_losses(RECIPES["hsdp_2x2"], WORLD)
    for name in RECIPES:
        for r in results:
            run = r[name]
            assert run.strategy == STRATEGIES[name]
            assert run.meshes == MESHES[name]  # every dense parameter is FSDP-managed
            assert run.losses == pytest.approx(expected, rel=1e-5, abs=1e-6), name
    # the losses moved: the comparison is over real training, not three equal numbers
    assert len(set(expected)) == len(expected)
