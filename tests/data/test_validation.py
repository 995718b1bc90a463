"""Bad input on disk: every problem is a DataError that names the file and the row."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gem_platform.data.config import DataConfig
from gem_platform.data.parquet import SampleTable, load_meta, to_arrow, write_split
from gem_platform.data.prepare import prepare_dataset
from gem_platform.errors import DataError


@pytest.fixture
def dataset(tmp_path: Path, hand) -> Path:
    """Two good train shards of 6 rows each (files train-00000 and train-00001)."""
    hand.meta(12).save(tmp_path)
    write_split(
        tmp_path,
        "train",
        hand.arrays([2, 0, 3, 1, 4, 2] * 2, [1, 2, 0, 1, 1, 3] * 2),
        hand.specs,
        rows_per_shard=6,
    )
    return tmp_path


def _rewrite(path: Path, edit: Callable[[pa.Table], pa.Table]) -> None:
    pq.write_table(edit(pq.read_table(path)), path)


def _set(table: pa.Table, name: str, values, typ: pa.DataType) -> pa.Table:
    i = table.column_names.index(name)
    return table.set_column(i, name, pa.array(values, type=typ))


def _list_set(table: pa.Table, name: str, row: int, pos: int, value) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row][pos] = value
    return _set(table, name, values, table.schema.field(name).type)


def _scalar_set(table: pa.Table, name: str, row: int, value) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row] = value
    return _set(table, name, values, table.schema.field(name).type)


def _load_error(path: Path, **kw) -> str:
    with pytest.raises(DataError) as err:
        SampleTable.load(path, "train", **kw)
    assert err.value.fix  # every error says what to do
    return str(err.value)


def test_good_dataset_loads(dataset: Path) -> None:
    assert len(SampleTable.load(dataset, "train")) == 12


@pytest.mark.parametrize(
    ("edit", "row", "needle"),
    [
        (lambda t: _scalar_set(t, "seq_len", 3, -1), 3, "negative history length -1"),
        (lambda t: _scalar_set(t, "seq_len", 2, 5), 2, "list length 3 but seq_len is 5"),
        (lambda t: _scalar_set(t, "ctr", 5, 2), 5, "'ctr': value 2 outside [0, 2)"),
        (lambda t: _scalar_set(t, "cvr", 4, -1), 4, "'cvr': value -1"),
        (lambda t: _scalar_set(t, "cvr", 0, 1), 0, "not clicked"),
        (lambda t: _list_set(t, "seq_item_ids", 4, 2, 51), 4, "value 51 outside [1, 51)"),
        (lambda t: _list_set(t, "seq_item_ids", 0, 0, 0), 0, "seq_item_ids"),
        (lambda t: _list_set(t, "seq_action_types", 2, 1, 3), 2, "seq_action_types"),
        (lambda t: _list_set(t, "seq_age", 5, 0, float("nan")), 5, "seq_age"),
        (lambda t: _scalar_set(t, "ad_item_id", 1, 0), 1, "ad_item_id"),
        (lambda t: _scalar_set(t, "sparse__color", 3, 5), 3, "sparse__color"),
        (lambda t: _list_set(t, "sparse__tags", 5, 2, 9), 5, "sparse__tags"),
        (lambda t: _list_set(t, "dense", 1, 0, float("inf")), 1, "dense"),
        (lambda t: _scalar_set(t, "dense", 2, [1.0]), 2, "1 values where dense_dim is 2"),
        (lambda t: _scalar_set(t, "ad_item_id", 4, None), 4, "null value"),
    ],
)
def test_bad_values_name_file_and_row(dataset: Path, edit, row: int, needle: str) -> None:
    bad = dataset / "train-00001.parquet"
    _rewrite(bad, edit)
    msg = _load_error(dataset)
    assert f"train-00001.parquet, row {row}," in msg
    assert needle in msg


def test_missing_column_is_named(dataset: Path) -> None:
    _rewrite(dataset / "train-00000.parquet", lambda t: t.drop_columns(["seq_age"]))
    msg = _load_error(dataset)
    assert "train-00000.parquet" in msg and "'seq_age': missing column" in msg


def test_wrong_column_type_is_named(dataset: Path) -> None:
    _rewrite(dataset / "train-00000.parquet", lambda t: _set(t, "ctr", ["yes"] * 6, pa.string()))
    msg = _load_error(dataset)
    assert "train-00000.parquet" in msg and "'ctr'" in msg


@pytest.mark.parametrize("content", [b"this is not parquet at all", b""])
def test_garbage_bytes_are_reported(dataset: Path, content: bytes) -> None:
    (dataset / "train-00001.parquet").write_bytes(content)
    msg = _load_error(dataset)
    assert "train-00001.parquet: not a readable Parquet file" in msg


def test_truncated_file_is_reported(dataset: Path) -> None:
    path = dataset / "train-00000.parquet"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert "train-00000.parquet" in _load_error(dataset)


def test_missing_shard_is_noticed(dataset: Path) -> None:
    (dataset / "train-00001.parquet").unlink()
    msg = _load_error(dataset)
    assert "meta.json says 12 samples but train-00000.parquet hold 6 rows" in msg


def test_rows_are_numbered_within_their_file_on_every_rank(dataset: Path) -> None:
    # 12 rows over 4 ranks: rank 3 reads rows 3..5 of train-00001.
    _rewrite(dataset / "train-00001.parquet", lambda t: _scalar_set(t, "ctr", 4, 7))
    msg = _load_error(dataset, rank=3, world_size=4)
    assert "train-00001.parquet, row 4," in msg
    SampleTable.load(dataset, "train", rank=0, world_size=4)  # rows it doesn't own don't matter


def test_missing_dataset_directory_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        SampleTable.load(tmp_path / "nowhere", "train")
    assert "nowhere" in err.value.problem and "data.path" in err.value.fix
    with pytest.raises(DataError, match="data.path"):
        prepare_dataset(DataConfig(source="parquet", path=str(tmp_path / "nowhere")))


def test_directory_without_meta_or_shards(tmp_path: Path, hand) -> None:
    with pytest.raises(DataError, match="meta.json is missing"):
        load_meta(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="meta.json is not valid JSON"):
        load_meta(tmp_path)
    hand.meta(1).save(tmp_path)
    with pytest.raises(DataError, match="No eval shards"):
        SampleTable.load(tmp_path, "eval")


def test_to_arrow_schema_is_stable(hand) -> None:
    table = to_arrow(hand.arrays([1, 2], [1, 1]), hand.specs)
    assert table.column_names == [
        "seq_len",
        "seq_item_ids",
        "seq_action_types",
        "seq_age",
        "ad_item_id",
        "sparse__color",
        "sparse__tags",
        "dense",
        "ctr",
        "cvr",
    ]
    assert np.asarray(table.column("seq_len")).tolist() == [1, 2]


def test_to_arrow_with_categories_adds_their_columns(hand) -> None:
    table = to_arrow(hand.categorized(hand.arrays([1, 2], [1, 1])), hand.specs)
    names = table.column_names
    assert names[names.index("ad_item_id") + 1 :][:2] == ["seq_item_categories", "ad_category"]
    assert table.column("seq_item_categories").to_pylist() == [[1], [2, 2]]


@pytest.mark.parametrize(
    ("edit", "row", "needle"),
    [
        (lambda t: _list_set(t, "seq_item_categories", 2, 1, 4), 2, "value 4 outside [0, 4)"),
        (lambda t: _scalar_set(t, "ad_category", 3, -1), 3, "'ad_category': value -1"),
        (
            lambda t: _scalar_set(t, "seq_item_categories", 1, [0]),
            1,
            "list length 1 but seq_len is 0",
        ),
        (lambda t: t.drop_columns(["ad_category"]), None, "missing column"),
    ],
)
def test_bad_categories_name_file_row_and_column(
    tmp_path: Path, hand, edit, row, needle
) -> None:
    hand.meta(6, num_categories=hand.num_categories).save(tmp_path)
    arrays = hand.categorized(hand.arrays([2, 0, 3, 1, 4, 2], [1, 2, 0, 1, 1, 3]))
    write_split(tmp_path, "train", arrays, hand.specs, rows_per_shard=6)
    _rewrite(tmp_path / "train-00000.parquet", edit)
    msg = _load_error(tmp_path)
    assert "train-00000.parquet" in msg and needle in msg
    if row is not None:
        assert f"row {row}" in msg
