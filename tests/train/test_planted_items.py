"""model.item_vectors=planted: the synthetic world's own item vectors stand for the items, a
diagnostic that separates learning the tables from the rest of the network."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gem_platform.data.synthetic import PlantedWorld
from gem_platform.errors import RecipeError
from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import build_model
from tests.tiny_training import tiny_tree, train_losses


def test_planted_vectors_stand_for_items_and_the_run_trains(tmp_path):
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=4)
    tree["model"]["item_vectors"] = "planted"
    recipe = recipe_from_dict(tree)
    world = PlantedWorld.build(recipe.data.synthetic)
    from gem_platform.data.prepare import prepare_dataset

    model = build_model(recipe, prepare_dataset(recipe.data), torch.device("cpu"))
    k = world.item_vec.shape[1]
    np.testing.assert_array_equal(model.planted_items[:, :k].numpy(), world.item_vec)
    assert not model.planted_items[:, k:].any()
    assert "planted_items" not in model.state_dict()  # fixed, derived from the data's seed

    losses, summary = train_losses(tree)
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert np.isfinite(summary["eval/ne_ctr"])


def test_planted_vectors_need_synthetic_data(tmp_path):
    tree = tiny_tree(tmp_path / "data")
    tree["model"]["item_vectors"] = "planted"
    tree["data"] = {"source": "parquet", "path": str(tmp_path / "data")}
    with pytest.raises(RecipeError, match="item_vectors=planted needs synthetic data"):
        recipe_from_dict(tree)
