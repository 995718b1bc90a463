"""HSDP on a 2x2 (replicate x shard) mesh of 4 gloo processes trains like one process on the
global batch; so does the replicate-only (4x1) mesh."""

from __future__ import annotations

import functools

import pytest

from tests.parallel.harness import reference_losses, run_recipes, spawn, tiny_recipe

WORLD = 4
RECIPES = {
    "hsdp_2x2": tiny_recipe(workers=WORLD, hsdp_shard_group=2),
    "replicate_only": tiny_recipe(workers=WORLD, hsdp_shard_group=1),
}
MESHES = {"hsdp_2x2": {(2, 2)}, "replicate_only": {(4, 1)}}


@pytest.mark.slow
def test_hsdp_matches_single_process():
    results = spawn(functools.partial(run_recipes, RECIPES), WORLD)
    expected = reference_losses(RECIPES["hsdp_2x2"], WORLD)
    for name in RECIPES:
        for r in results:
            run = r[name]
            assert run.strategy == "hsdp"
            assert run.meshes == MESHES[name]  # every dense parameter is FSDP-managed
            assert run.losses == pytest.approx(expected, rel=1e-5, abs=1e-6), name
    # the losses moved: the comparison is over real training, not three equal numbers
    assert len(set(expected)) == len(expected)
