"""TorchRec-sharded embedding tables (DistributedModelParallel, planner-made plans) train like
the unsharded tables of one process on the global batch."""

from __future__ import annotations

import functools

import pytest

from tests.parallel.harness import assert_match_reference, run_recipes, spawn, tiny_recipe

WORLD = 2
RECIPES = {
    layout: tiny_recipe(workers=WORLD, embedding_sharding=layout)
    for layout in ("table_wise", "row_wise")
}


@pytest.mark.slow
def test_sharded_embeddings_match_single_process():
    results = spawn(functools.partial(run_recipes, RECIPES), WORLD)
    for r in results:
        for name in RECIPES:
            run = r[name, "adamw"]
            assert run.strategy == "torchrec_sharding"
            assert run.num_sparse_params == 0  # tables train with TorchRec's fused optimizer
    assert_match_reference(results, RECIPES, WORLD)
