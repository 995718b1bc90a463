"""train.lr_fan_in_ref: wide-input layers train at lr x ref / fan-in, the rest at lr, in the
real training loop (AdamW moves each weight by about its group's lr a step)."""

from __future__ import annotations

import pytest
import torch

from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train
from gem_platform.train.optim import dense_optimizer
from tests.tiny_training import tiny_tree

EXPERT_IN = "dhen.0.experts.0.net.0.weight"  # fan-in: every DHEN token x d_model
SEQUENCE_QKV = "sequence.blocks.0.qkv.weight"  # fan-in: d_model


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {name: params[name].detach().clone() for name in (EXPERT_IN, SEQUENCE_QKV)}


def _second_step_moves(tree: dict) -> tuple[dict[str, float], int]:
    """The largest change of each watched weight made by the second training step, and the
    expert's fan-in."""
    seen: list[dict[str, torch.Tensor]] = []
    train(recipe_from_dict(tree), echo=lambda _: None,
          on_step=lambda step, model: seen.append(_weights(model)))
    moves = {name: float((seen[1][name] - seen[0][name]).abs().max()) for name in seen[0]}
    return moves, seen[0][EXPERT_IN].shape[1]


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tiny_tree(tmp_path / "data", seq_layers=1, steps=2, eval_every=0, lr=1e-3,
                     weight_decay=0.0)


def test_wide_layers_move_by_ref_over_fan_in(tree):
    plain, fan_in = _second_step_moves(tree)
    tree["train"]["lr_fan_in_ref"] = 16  # the tiny model's d_model
    scaled, _ = _second_step_moves(tree)
    assert fan_in >= 4 * 16  # the DHEN layer reads every token of 16 values
    # Unscaled, both layers move by about lr; scaled, the expert by lr x 16 / fan-in and the
    # sequence layer (fan-in 16, not above the reference) still by lr.
    for moves in (plain, scaled):
        assert moves[SEQUENCE_QKV] == pytest.approx(1e-3, rel=0.3)
    assert plain[EXPERT_IN] == pytest.approx(1e-3, rel=0.3)
    assert scaled[EXPERT_IN] == pytest.approx(1e-3 * 16 / fan_in, rel=0.3)


def test_groups_follow_fan_in(tree):
    tree["train"]["lr_fan_in_ref"] = 16
    recipe = recipe_from_dict(tree)
    wide = torch.nn.Linear(16 * 7, 8)
    narrow = torch.nn.Linear(16, 8)
    opt = dense_optimizer([*narrow.parameters(), *wide.parameters()], recipe.train,
                          torch.device("cpu"))
    lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert lrs[id(wide.weight)] == pytest.approx(1e-3 * 16 / (16 * 7))
    assert lrs[id(wide.bias)] == lrs[id(narrow.weight)] == lrs[id(narrow.bias)] == 1e-3
    assert len(opt.param_groups) == 2
