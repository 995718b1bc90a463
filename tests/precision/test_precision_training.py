"""Every precision mode trains end to end on CPU: bf16 autocast and FP8 block-scaled linears
run through the same jagged attention references as fp32, so the precision ablation's quality
can be measured on any machine."""

from __future__ import annotations

import math

import pytest
import yaml

from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train
from tests.tiny_training import TINY


@pytest.mark.parametrize("attention", ["full", "block64"])
@pytest.mark.parametrize("precision", [{"mode": "bf16"},
                                       {"mode": "fp8_block", "block": 32, "keep_last_bf16": 1}])
def test_precision_mode_trains(tmp_path, monkeypatch, attention, precision):
    monkeypatch.chdir(tmp_path)
    tree = yaml.safe_load(TINY.format(data=tmp_path / "data"))
    tree["model"].update(d_model=32, attention=attention)
    tree["train"].update(steps=3, log_every=1)
    tree["parallel"]["workers"] = 1
    tree["precision"] = precision
    losses: list[float] = []
    summary = train(recipe_from_dict(tree),
                    sink=lambda m, s: losses.append(m["train/loss"]) if "train/loss" in m
                    else None, echo=lambda _: None)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert 0.0 < summary["eval/auc_ctr"] < 1.0
