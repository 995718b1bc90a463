"""train.sparse_accumulator_init reaches the Adagrad that trains the tables, on both paths:
torch's Adagrad over plain tables, and TorchRec's fused optimizer inside the backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train
from tests.tiny_training import tiny_tree


def _item_table(model: torch.nn.Module) -> torch.Tensor:
    for name, value in model.state_dict().items():
        if name.endswith("embeddings.item.weight"):
            pieces = [s.tensor for s in value.local_shards()] if hasattr(
                value, "local_shards") else [value]
            return torch.cat([p.detach().clone() for p in pieces])
    raise AssertionError("no item table")


def _largest_second_step(tree: dict, init: float) -> float:
    """The largest change of an item-table element made by the second training step."""
    tree = {**tree, "train": {**tree["train"], "sparse_accumulator_init": init}}
    seen: list[torch.Tensor] = []
    train(recipe_from_dict(tree), echo=lambda _: None,
          on_step=lambda step, model: seen.append(_item_table(model)))
    return float((seen[1] - seen[0]).abs().max())


@pytest.fixture(params=["plain", "fused"])
def tables(request, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=2, eval_every=0, sparse_lr=0.05)
    if request.param == "fused":
        tree["parallel"]["embedding_sharding"] = "table_wise"
    yield tree
    if dist.is_initialized():
        dist.destroy_process_group()


def test_accumulator_init_sets_the_size_of_the_early_table_steps(tables):
    # From 0 an element's step is lr * g / sqrt(sum g^2): about lr whatever the gradient.
    assert _largest_second_step(tables, 0.0) > 0.02
    # From 100 it is lr * g / 10: far smaller than lr for any gradient a tiny model makes.
    assert _largest_second_step(tables, 100.0) < 1e-3
