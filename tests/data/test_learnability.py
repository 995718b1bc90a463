"""Samples per id and the ceilings they leave (gem_platform.data.learnability)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gem_platform.data.learnability import learnable_effects, report
from gem_platform.data.parquet import SampleTable, load_meta
from gem_platform.data.synthetic import SPARSE_EFFECT_STD, generate_synthetic


def test_an_ideal_learner_recovers_an_effect_only_from_enough_samples() -> None:
    rng = np.random.default_rng(0)
    effects = SPARSE_EFFECT_STD * rng.standard_normal(20000)
    unseen = learnable_effects(effects, np.zeros(effects.size), rng)
    np.testing.assert_array_equal(unseen, 0.0)
    # half the variance is recovered where the information equals the prior's precision
    half = learnable_effects(effects, np.full(effects.size, SPARSE_EFFECT_STD**-2), rng)
    assert np.corrcoef(half, effects)[0, 1] ** 2 == pytest.approx(0.5, abs=0.03)
    plenty = learnable_effects(effects, np.full(effects.size, 1e6), rng)
    np.testing.assert_allclose(plenty, effects, atol=0.01)


def test_report_counts_the_written_dataset(make_config, tmp_path: Path) -> None:
    """The counts are those of the dataset the generator writes, and thinner ids leave a lower
    ceiling than the planted one."""
    cfg = make_config(tmp_path, num_users=1500)
    result = report(cfg.synthetic)
    generate_synthetic(cfg)
    train = SampleTable.load(tmp_path, "train").arrays
    evals = SampleTable.load(tmp_path, "eval").arrays
    per_user = np.bincount(train.sparse_values["user_id"], minlength=1500)
    users = result["samples_per_id"]["user_id"]
    assert users["mean_per_id"] == pytest.approx(len(train) / 1500)
    assert users["median_seen"] == np.median(per_user[evals.sparse_values["user_id"]])
    assert users["unseen"] == pytest.approx(np.mean(per_user[evals.sparse_values["user_id"]] == 0))
    items = np.bincount(train.ad_item_id, minlength=cfg.synthetic.num_items + 1)
    assert result["samples_per_id"]["ad_item"]["median_seen"] == np.median(
        items[evals.ad_item_id])

    ctr = result["auc"]["ctr"]
    assert ctr["planted"] == pytest.approx(load_meta(tmp_path).planted_auc["ctr"])
    assert ctr["ids_and_category"] < ctr["ids_as_learnable"] < ctr["planted"]
    assert ctr["category_level"] < ctr["planted"]


def test_command_prints_json(make_config, tmp_path: Path, capsys) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({"name": "r", "data": make_config(tmp_path / "d").model_dump(
        mode="json")}))
    from gemctl.main import app

    result = CliRunner().invoke(app, ["data", "learnability", str(recipe), "--set",
                                      "data.synthetic.num_users=100", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["num_users"] == 100
    assert set(out["auc"]["cvr"]) == {"planted", "ids_as_learnable", "category_level",
                                      "ids_and_category"}
