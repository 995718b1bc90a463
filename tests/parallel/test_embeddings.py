"""TorchRec-sharded embedding tables (DistributedModelParallel, planner-made plans) train like
the unsharded tables of one process on the global batch."""

from __future__ import annotations

import functools

import pytest
import torch

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


def _parallelize_error(rank: int, world: int) -> str:
    from gem_platform.errors import RecipeError
    from gem_platform.parallel import parallelize
    from gem_platform.train.loop import build_model
    from tests.parallel.harness import tiny_meta

    recipe = tiny_recipe(workers=world, embedding_group=1)
    try:
        parallelize(build_model(recipe, tiny_meta(), torch.device("cpu")), recipe)
    except RecipeError as e:
        return str(e)
    return ""


def test_replicated_embedding_groups_need_cuda():
    """Tables sharded per embedding group and replicated across groups (TorchRec's
    DMPCollection) are CUDA-only: on CPU the recipe is refused with the fix, on every rank."""
    messages = spawn(_parallelize_error, WORLD)
    for message in messages:
        assert "parallel.embedding_group=1" in message
        assert "DMPCollection" in message and "CUDA" in message


def test_planner_sees_the_gpus_real_memory(monkeypatch):
    """TorchRec's Topology assumes 32 GiB of HBM; told nothing else, its planner put a 4.5 GB
    table of an H200 run behind a UVM cache (an lru_cache kernel at every lookup)."""
    from types import SimpleNamespace

    from gem_platform.parallel.embeddings import EmbeddingShardingSpec, _topology

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(total_memory=150_000_000_000))
    topology = _topology(EmbeddingShardingSpec("table_wise", 1, 0.1, "cuda"))
    assert [d.storage.hbm for d in topology.devices] == [150_000_000_000]
    cpu = _topology(EmbeddingShardingSpec("table_wise", 2, 0.1, "cpu"))
    assert len(cpu.devices) == 2 and cpu.compute_device == "cpu"


def _wide(layout: str):
    recipe = tiny_recipe(workers=WORLD, embedding_sharding=layout)
    recipe.model.wide = True
    return recipe


@pytest.mark.slow
def test_sharded_wide_tables_match_single_process():
    """model.wide's tables (4 columns, FBGEMM's least) sharded table-, row- or column-wise over
    two ranks train as the unsharded model does in one process on the global batch."""
    recipes = {layout: _wide(layout) for layout in ("table_wise", "row_wise", "column_wise")}
    results = spawn(functools.partial(run_recipes, recipes), WORLD)
    for r in results:
        assert all(r[name, "adamw"].strategy == "torchrec_sharding" for name in recipes)
    assert_match_reference(results, recipes, WORLD)
