"""The training loop on the streaming reader: an interrupted and resumed run equals an
uninterrupted one mid-epoch, and over-long histories are refused or truncated and counted."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gem_platform.data.prepare import prepare_dataset
from gem_platform.errors import DataError
from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train
from tests.resume import crash_and_resume, losses_of

pytestmark = pytest.mark.slow  # trains a model end to end

TREE = {
    "name": "stream",
    "model": {"d_model": 16, "num_heads": 2, "pooled_queries": 2, "dhen_layers": 1,
              "expert_hidden": 32, "head_hidden": 32},
    "data": {"source": "synthetic",
             "synthetic": {"num_samples": 2400, "num_users": 300, "num_items": 300,
                           "rows_per_shard": 500,
                           "seq_len": {"dist": "lognormal", "mean": 24, "min": 1, "max": 96}}},
    # a window of 3 local batches over a 2160-sample split: 13 steps per epoch
    "loader": {"batching": "bbs_v2", "local_batch_size": 160, "window_samples": 480},
    "train": {"steps": 16, "log_every": 1, "warmup_steps": 2, "perf_warmup_steps": 2,
              "eval_max_samples": 256},
    "parallel": {"workers": 1},
}


def _tree(tmp_path, **train) -> dict:
    return {**TREE, "data": {**TREE["data"], "path": str(tmp_path / "data")},
            "train": {**TREE["train"], **train}}


def test_streaming_resume_mid_epoch_equals_uninterrupted(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    recipe = recipe_from_dict(_tree(tmp_path))
    full, _ = losses_of(recipe)
    # crash after step 15: past the step-14 checkpoint, in epoch 1, mid-epoch
    logged, summary = crash_and_resume(recipe, tmp_path / "ckpts", every=7, keep=2,
                                       crash_after=15, expect_checkpoint=14)
    assert [s for s, _ in logged] == [s for s, _ in full] == list(range(1, 17))
    for (_, a), (_, b) in zip(logged, full, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert summary["data/truncated_histories"] == 0.0


def _lengthen_one_history(path, row: int, events: int) -> None:
    """Give ``row`` of train-00001.parquet a history of ``events`` events."""
    file = path / "train-00001.parquet"
    table = pq.read_table(file)
    cols = {}
    for name in table.column_names:
        values = table.column(name).to_pylist()
        if name == "seq_len":
            values[row] = events
        elif name in ("seq_item_ids", "seq_action_types", "seq_item_categories"):
            values[row] = [values[row][-1] if values[row] else 1] * events
        elif name == "seq_age":
            values[row] = [float(events - i) for i in range(events)]
        cols[name] = pa.array(values, type=table.schema.field(name).type)
    pq.write_table(pa.table(cols, schema=table.schema), file)


@pytest.mark.parametrize("window", [None, 480])
def test_over_long_history_is_named_or_truncated(tmp_path, monkeypatch, window) -> None:
    monkeypatch.chdir(tmp_path)
    tree = _tree(tmp_path, steps=2)
    tree["loader"] = {**tree["loader"], "window_samples": window}
    recipe = recipe_from_dict(tree)
    meta = prepare_dataset(recipe.data)
    _lengthen_one_history(tmp_path / "data", row=7, events=meta.max_seq_len + 5000)
    with pytest.raises(DataError) as err:
        train(recipe, echo=lambda _: None)
    text = str(err.value)
    assert "train-00001.parquet, row 7, column 'seq_len'" in text
    assert f"longer than the dataset's max_seq_len {meta.max_seq_len}" in text
    assert "history_overflow: truncate" in err.value.fix

    tree["data"]["history_overflow"] = "truncate"
    summary = train(recipe_from_dict(tree), echo=lambda _: None)
    assert summary["data/truncated_histories"] == 1.0
    assert np.isfinite(summary["train/final_loss"])
