"""Dataset sizes that give the model a table no cluster could hold are refused with the field
and the limit: a recipe's data.synthetic at validate time, in well under a second, and a
meta.json passed to `gemctl plan --meta` before the model is built (torch's storage size used
to overflow inside it: a traceback and exit code 1). A table at the limit still plans."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gem_platform.topology.table_bounds import MAX_TABLE_BYTES, PARAM_BYTES
from tests.cli.conftest import REPO, clean_exit

DEMO = str(REPO / "recipes" / "demo.yaml")
D_MODEL = 32  # demo.yaml's model.d_model
# A refusal at validate time: well under a second on a quiet machine, more on a loaded 2-core
# CI machine; an unrefused size goes on to size (and build) exabyte tables.
AT_ONCE_S = 10.0
LIMIT_ROWS = MAX_TABLE_BYTES // (D_MODEL * PARAM_BYTES)  # item rows at the limit
META = {"source": "synthetic", "num_items": 50, "num_action_types": 4,
        "sparse_features": [{"name": "user_id", "vocab_size": 10}], "dense_dim": 4,
        "num_train": 100, "num_eval": 20, "ctr_base_rate": 0.1, "cvr_base_rate": 0.2,
        "max_seq_len": 8, "num_categories": 3}


def words(result) -> str:
    return " ".join((result.output + result.stderr).split())


@pytest.mark.parametrize("override, field", [
    (f"data.synthetic.num_items={2**53}", "data.synthetic.num_items"),
    (f"data.synthetic.num_users={2**50}", "data.synthetic.num_users"),
    (f"data.synthetic.dense_dim={2**50}", "data.synthetic.dense_dim"),
    (f"data.synthetic.sparse_features=[{{name: tags, vocab_size: {2**53}}}]",
     "data.synthetic.sparse_features.0.vocab_size"),
])
def test_recipe_sizes_beyond_any_cluster(gemctl, override, field):
    for command in ("validate", "plan"):
        start = time.perf_counter()
        result = gemctl(command, DEMO, "--set", override)
        clean_exit(result, 2)
        assert time.perf_counter() - start < AT_ONCE_S
        text = words(result)
        assert f"{field} makes" in text and "16.0 PiB" in text and "131,072 ranks" in text


@pytest.mark.parametrize("change, field", [
    ({"num_items": 2**62}, "num_items"),
    ({"num_action_types": 2**62}, "num_action_types"),
    ({"dense_dim": 2**62}, "dense_dim"),
    ({"sparse_features": [{"name": "u", "vocab_size": 2**62}]},
     "sparse_features[0].vocab_size"),
])
def test_meta_sizes_beyond_any_cluster(gemctl, tmp_path: Path, change, field):
    (tmp_path / "meta.json").write_text(json.dumps({**META, **change}))
    result = gemctl("plan", DEMO, "--meta", str(tmp_path / "meta.json"))
    clean_exit(result, 2)
    text = words(result)
    assert f"{tmp_path / 'meta.json'} can't be used: {field} makes" in text, text


def test_a_table_at_the_limit_plans(gemctl, tmp_path: Path):
    """The limit lies below what torch can build: the largest table allowed is priced."""
    (tmp_path / "meta.json").write_text(json.dumps({**META, "num_items": LIMIT_ROWS - 1}))
    result = gemctl("plan", DEMO, "--meta", str(tmp_path / "meta.json"), "--json")
    clean_exit(result, 0)
    assert max(json.loads(result.stdout)["sizes"]["embedding_table_bytes"]) == MAX_TABLE_BYTES
    (tmp_path / "meta.json").write_text(json.dumps({**META, "num_items": LIMIT_ROWS}))
    clean_exit(gemctl("plan", DEMO, "--meta", str(tmp_path / "meta.json")), 2)


def test_submit_refuses_a_meta_json_beyond_any_cluster_before_a_run_opens(gemctl, tmp_path,
                                                                           monkeypatch):
    """A dataset whose meta.json was edited to an impossible size: refused with exit code 2
    before a run is opened (the run used to open, fail inside the model and exit 1)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    sets = ["--set", f"data.path={tmp_path / 'ds'}", "--set", "data.synthetic.num_samples=600"]
    clean_exit(gemctl("data", "generate", DEMO, *sets), 0)
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    (tmp_path / "ds" / "meta.json").write_text(json.dumps({**meta, "num_items": 2**62}))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = gemctl("submit", DEMO, "--local", *sets, "--set", "data.source=parquet",
                    "--tracking-uri", uri)
    clean_exit(result, 2)
    assert "can't be used: num_items makes the item table" in words(result)
    experiments = [e.experiment_id for e in MlflowClient(uri).search_experiments()]
    assert not MlflowClient(uri).search_runs(experiments)
