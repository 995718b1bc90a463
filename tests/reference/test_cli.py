"""`gemctl data reference` (table, --json, bad input) and the linear reference beside the
model in a run's summary and its MLflow record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from gemctl import render
from gemctl.main import app
from tests.conftest import run_gemctl
from tests.tiny_training import TINY

REFERENCE_NAME = "reference-linear.json"


def gemctl(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=True, terminal_width=120,
                              prog_name="gemctl")


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY.format(data=tmp_path / "data"))
    return path


def test_data_reference_table_then_cached_json(recipe: Path, tmp_path: Path):
    first = gemctl("data", "reference", str(recipe))
    assert first.exit_code == 0, first.output + str(first.exception)
    assert "linear reference (held-out)" in first.output and "planted AUC" in first.output
    assert "trained in" in first.output and REFERENCE_NAME in first.output
    for task in ("ctr", "cvr"):
        assert f"│ {task} " in first.output
    second = gemctl("data", "reference", str(recipe), "--json")
    assert second.exit_code == 0, second.output
    doc = json.loads(second.stdout)
    assert doc["cached"] is True and doc["cache_file"].endswith(REFERENCE_NAME)
    assert doc["metrics"]["reference/linear/auc_ctr"] == doc["tasks"]["ctr"]["auc"]
    assert set(doc["planted_auc"]) == {"ctr", "cvr"}


def test_data_reference_epochs_is_cached_apart_from_the_default(recipe: Path, tmp_path: Path):
    """Another number of passes is trained and cached in a file of its own: the default
    reference that runs compare against is neither evicted nor replaced by it."""
    default = json.loads(gemctl("data", "reference", str(recipe), "--json").stdout)
    one = gemctl("data", "reference", str(recipe), "--epochs", "1", "--json")
    assert one.exit_code == 0, one.output
    doc = json.loads(one.stdout)
    assert doc["cached"] is False and doc["config"]["epochs"] == 1
    assert Path(doc["cache_file"]).name.startswith("reference-linear-")
    assert Path(doc["cache_file"]).name != REFERENCE_NAME
    assert doc["train_samples"] * 3 == default["train_samples"]  # one pass, not three
    again = json.loads(gemctl("data", "reference", str(recipe), "--json").stdout)
    assert again["cached"] is True and again["tasks"] == default["tasks"]
    assert json.loads(gemctl("data", "reference", str(recipe), "--epochs", "1",
                             "--json").stdout)["cached"] is True
    bad = gemctl("data", "reference", str(recipe), "--epochs", "0")
    assert bad.exit_code == 2 and "Traceback" not in bad.output


@pytest.mark.parametrize("args, needle", [
    (["nope.yaml"], "does not exist"),
    (["RECIPE", "--set", "data.source=parquet", "--set", "data.path=/nonexistent/ds"],
     "does not exist"),
])
def test_data_reference_bad_input(recipe: Path, args, needle):
    result = gemctl("data", "reference", *[str(recipe) if a == "RECIPE" else a for a in args])
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "Traceback" not in result.output + result.stderr


def test_summary_table_shows_the_reference_beside_the_model():
    summary = {"eval/ne_ctr": 0.9, "eval/auc_ctr": 0.7, "eval/ne_cvr": 0.95,
               "eval/auc_cvr": 0.6, "reference/linear/ne_ctr": 0.85,
               "reference/linear/auc_ctr": 0.78, "reference/linear/ne_cvr": 0.93,
               "reference/linear/auc_cvr": 0.66}
    out = render.wide()
    with out.capture() as captured:
        out.print(render.summary_tables("run", summary, "sqlite:///x.db")[0])
    text = captured.get()
    assert "linear reference ne" in text and "0.8500" in text and "0.9300" in text
    assert "linear reference auc" in text and "0.7800" in text and "0.6600" in text
    with out.capture() as captured:
        out.print(render.summary_tables("run", {"eval/ne_ctr": 0.9}, "sqlite:///x.db")[0])
    assert "linear reference" not in captured.get()


@pytest.mark.slow
def test_submit_shows_and_records_the_reference(tmp_path: Path):
    """A local run on a small dataset: the reference is trained once (then cached beside the
    data), shown under the run's own held-out figures and logged as reference/linear/*."""
    tree = yaml.safe_load(TINY.format(data=tmp_path / "data"))
    tree["train"]["steps"] = 4
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tree))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_gemctl("submit", "run.yaml", "--local", "--tracking-uri", uri, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "linear reference ne" in proc.stdout and "linear reference auc" in proc.stdout
    cached = json.loads((tmp_path / "data" / REFERENCE_NAME).read_text())
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("cli-test").experiment_id])
    for task in ("ctr", "cvr"):
        for name in ("ne", "auc"):
            logged = run.data.metrics[f"reference/linear/{name}_{task}"]
            assert logged == pytest.approx(cached["tasks"][task][name])
