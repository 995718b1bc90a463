"""Expert parallelism: 2 gloo processes each hold half of every DHEN layer's experts and
exchange tokens; training matches one process holding all experts on the global batch."""

from __future__ import annotations

import functools

import pytest

from gem_platform.errors import RecipeError
from gem_platform.parallel.experts import expert_share
from tests.parallel.harness import assert_match_reference, run_recipes, spawn, tiny_recipe

WORLD = 2
# two "hosts" of one rank each would forbid a 2-rank expert group: state 2 ranks per host
RECIPES = {
    "experts": tiny_recipe(workers=WORLD, gpus_per_host=2, expert_parallel=2),
    "experts_hsdp": tiny_recipe(workers=WORLD, gpus_per_host=2, expert_parallel=2,
                                hsdp_shard_group=2),
}


def test_expert_share_splits_evenly():
    assert [list(expert_share(4, 2, p)) for p in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(RecipeError, match="num_experts=3"):
        expert_share(3, 2, 0)


@pytest.mark.slow
def test_expert_parallel_matches_single_process():
    results = spawn(functools.partial(run_recipes, RECIPES), WORLD)
    for r in results:
        assert r["experts", "adamw"].strategy == "expert_parallel"
        # each expert on its own (replicate, shard) mesh of one rank; dense stay plain replicas
        assert r["experts", "adamw"].meshes == {(1, 1)}
        assert r["experts_hsdp", "adamw"].strategy == "hsdp+expert_parallel"
        assert r["experts_hsdp", "adamw"].meshes == {(1, 2), (1, 1)}
    assert_match_reference(results, RECIPES, WORLD)
