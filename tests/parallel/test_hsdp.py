"""HSDP on a 2x2 (replicate x shard) mesh of 4 gloo processes trains like one process on the
global batch; so do the replicate-only (4x1) mesh, the layout of recipes/hsdp_cpu.yaml
(HSDP + expert parallelism + row-wise sharded tables on 2 stand-in hosts of 2 ranks) and
experts FSDP-sharded over both hosts."""

from __future__ import annotations

import functools

import pytest

from tests.parallel.harness import assert_match_reference, run_recipes, spawn, tiny_recipe

WORLD = 4
RECIPES = {
    "hsdp_2x2": tiny_recipe(workers=WORLD, hsdp_shard_group=2),
    "replicate_only": tiny_recipe(workers=WORLD, hsdp_shard_group=1),
    "all": tiny_recipe(workers=WORLD, gpus_per_host=2, hsdp_shard_group=2, expert_parallel=2,
                       embedding_sharding="row_wise"),
    "experts_sharded": tiny_recipe(workers=WORLD, gpus_per_host=2, hsdp_shard_group=4,
                                   expert_parallel=2),
}
STRATEGIES = {"hsdp_2x2": "hsdp", "replicate_only": "hsdp",
              "all": "hsdp+expert_parallel+torchrec_sharding",
              "experts_sharded": "hsdp+expert_parallel"}
# dense (replicate, shard) mesh, then the experts' mesh: with a 2-rank dense shard group the
# experts are replicated over both hosts (2, 1); with a 4-rank one, sharded over them (1, 2)
MESHES = {"hsdp_2x2": {(2, 2)}, "replicate_only": {(4, 1)}, "all": {(2, 2), (2, 1)},
          "experts_sharded": {(1, 4), (1, 2)}}


@pytest.mark.slow
def test_hsdp_matches_single_process():
    results = spawn(functools.partial(run_recipes, RECIPES), WORLD)
    for name in RECIPES:
        for r in results:
            run = r[name, "adamw"]
            assert run.strategy == STRATEGIES[name]
            assert run.meshes == MESHES[name]  # every dense parameter is FSDP-managed
    assert_match_reference(results, RECIPES, WORLD)
