"""gemctl bench terms: the fit of a model's logit on the planted terms, and the command on a
tiny synthetic recipe (trained here, one process)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from gem_bench.terms import capture, held_out_terms
from gem_platform.recipe import recipe_from_dict
from gemctl.main import app
from tests.tiny_training import TINY


def test_capture_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    terms = {"a": rng.standard_normal(5000), "b": rng.standard_normal(5000),
             "c": rng.standard_normal(5000)}
    logits = 1.0 * terms["a"] + 0.25 * terms["b"] + 0.3 + 0.1 * rng.standard_normal(5000)
    got = capture(logits, terms)
    assert got.coef["a"] == pytest.approx(1.0, abs=0.01)
    assert got.coef["b"] == pytest.approx(0.25, abs=0.01)
    assert abs(got.coef["c"]) < 0.01 and abs(got.partial_corr["c"]) < 0.05
    assert got.partial_corr["a"] > 0.99 and got.r2 > 0.98
    assert got.residual_std == pytest.approx(0.1, rel=0.05)


@pytest.mark.slow
def test_command_writes_the_fit_of_a_trained_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY.format(data="data"))
    # 240 held-out samples in shards of 100: --max-samples 150 fits on the first two shards
    proc = CliRunner().invoke(app, ["bench", "terms", "tiny.yaml", "--out", "res",
                                    "--set", "train.steps=4", "--set",
                                    "data.synthetic.rows_per_shard=100", "--max-samples", "150",
                                    "--reference"])
    assert proc.exit_code == 0, (proc.exception, proc.stdout)
    result = json.loads((tmp_path / "res" / "terms_bench.json").read_text())
    assert result["held_out_samples"] == 200
    cap = result["capture"]
    assert {"recent_affinity", "sparse_ids", "dense"} <= set(cap["coef"])
    assert set(cap["coef"]) == set(cap["partial_corr"]) == set(result["term_auc_ctr"])
    assert all(np.isfinite(v) for v in cap["coef"].values())
    assert 0.0 <= cap["r2"] <= 1.0 and 0.5 < result["planted_auc_ctr"] <= 1.0
    assert "planted term" in proc.stdout and "partial" in proc.stdout
    # the run's own held-out scores of both tasks and its curve are kept beside the fit
    assert result["eval"]["eval/ne_ctr"] == result["eval/ne_ctr"]
    assert {"eval/ne_cvr", "eval/auc_ctr", "eval/auc_cvr"} <= set(result["eval"])
    assert result["curve"] and result["curve"][-1]["step"] == 4
    assert result["curve"][-1]["ne_ctr"] == pytest.approx(result["eval/ne_ctr"])
    # --reference: the linear reference's logit fitted on the same terms and rows
    ref = result["reference"]
    assert set(ref["capture"]["coef"]) == set(cap["coef"]) and ref["epochs"] >= 1
    assert 0.5 < ref["auc_ctr"] <= 1.0 and 0.0 <= ref["capture"]["r2"] <= 1.0
    assert "ref. coef" in proc.stdout


def test_held_out_terms_of_the_first_shards_are_the_whole_splits_first_rows():
    recipe = recipe_from_dict(yaml.safe_load(TINY.format(data="unused")) | {
        "parallel": {"workers": 1}})
    recipe.data.synthetic.rows_per_shard = 100  # 240 held-out samples: shards of 100, 100, 40
    whole, whole_labels = held_out_terms(recipe)
    first, first_labels = held_out_terms(recipe, max_samples=101)
    assert len(whole_labels) == 240 and len(first_labels) == 200
    np.testing.assert_array_equal(first_labels, whole_labels[:200])
    for name, values in first.items():
        np.testing.assert_array_equal(values, whole[name][:200])


def test_command_refuses_data_without_planted_terms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY.format(data="data"))
    proc = CliRunner().invoke(app, ["bench", "terms", "tiny.yaml", "--set",
                                    "data.source=parquet"])
    assert proc.exit_code == 2
    assert "only a generated (synthetic) world has planted terms" in proc.stderr
