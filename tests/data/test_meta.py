"""meta.json as input: whatever a file holds (wrong types, out-of-range or non-finite numbers,
missing or unknown fields, not JSON at all), reading it gives a checked DatasetMeta or a
DataError naming the file and the field; never a crash later in training."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gem_platform.data.meta import MAX_COUNT, META_FILE, DatasetMeta, parse_meta
from gem_platform.data.parquet import load_meta
from gem_platform.errors import DataError, GemError
from tests.data.conftest import Handmade, refused

REPO = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in fields(DatasetMeta)]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=8)


def _valid() -> dict:
    meta = Handmade.meta(7, 3, num_categories=4)
    meta.planted_auc = {"ctr": 0.7, "cvr": float("nan")}
    meta.extra = {"seq_len_histogram": [0, 2, 5], "config_hash": "v3-0123456789abcdef"}
    return json.loads(json.dumps(asdict(meta)))


def _well_typed(meta: DatasetMeta) -> None:
    """What the rest of the platform relies on once a meta.json was accepted."""
    for name in ("num_items", "num_action_types", "dense_dim", "num_train", "num_eval",
                 "max_seq_len", "num_categories"):
        value = getattr(meta, name)
        assert type(value) is int and 0 <= value <= MAX_COUNT, name
    assert meta.num_items >= 1 and meta.num_action_types >= 1
    for rate in (meta.ctr_base_rate, meta.cvr_base_rate):
        assert isinstance(rate, int | float) and 0 <= rate <= 1 and math.isfinite(rate)
    assert isinstance(meta.source, str) and meta.source
    names = [s.name for s in meta.sparse_features]
    assert len(set(names)) == len(names)
    for spec in meta.sparse_features:
        assert type(spec.vocab_size) is int and spec.vocab_size >= 1
        assert type(spec.multi_hot) is bool
    assert isinstance(meta.extra, dict)


def test_a_valid_meta_round_trips(tmp_path) -> None:
    raw = _valid()
    (tmp_path / META_FILE).write_text(json.dumps(raw))
    meta = load_meta(tmp_path)
    _well_typed(meta)
    assert asdict(meta).keys() == raw.keys() and meta.num_train == 7


@pytest.mark.parametrize("field, value, needle", [
    ("num_train", "abc", "field 'num_train' is 'abc', not a whole number >= 0"),
    ("num_items", 0, "field 'num_items' is 0, not a whole number >= 1"),
    ("num_eval", 1.5, "'num_eval' is 1.5"),
    ("dense_dim", True, "'dense_dim' is True"),
    ("ctr_base_rate", float("nan"), "'ctr_base_rate' is nan, not a number between 0 and 1"),
    ("cvr_base_rate", "0.2", "'cvr_base_rate'"),
    ("max_seq_len", 2**80, "'max_seq_len'"),
    ("sparse_features", [{"name": "a", "vocab_size": "9"}], "sparse_features[0].vocab_size"),
    ("sparse_features", [{"name": "a", "vocab_size": 3}, {"name": "a", "vocab_size": 3}],
     "sparse_features[1].name"),
    ("sparse_features", {"name": "a"}, "'sparse_features'"),
    ("planted_auc", [0.5], "'planted_auc'"),
    ("extra", {"seq_len_histogram": ["x"]}, "extra.seq_len_histogram"),
    ("extra", [], "'extra'"),
])
def test_a_wrong_field_is_named(tmp_path, field, value, needle) -> None:
    raw = _valid()
    raw[field] = value
    (tmp_path / META_FILE).write_text(json.dumps(raw))
    with pytest.raises(DataError) as err:
        load_meta(tmp_path)
    assert str(tmp_path / META_FILE) in err.value.problem
    assert needle in err.value.problem


@pytest.mark.parametrize("text, needle", [
    ('{"not": "meta"}', "unknown fields ['not']"),
    ("[1, 2]", "holds list, not a dataset description"),
    ("{", "is not valid JSON"),
    ("1" * 5000, "is not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),
])
def test_a_file_that_is_not_a_description_is_refused(tmp_path, text, needle) -> None:
    (tmp_path / META_FILE).write_text(text)
    with pytest.raises(DataError, match="meta.json") as err:
        load_meta(tmp_path)
    assert needle in err.value.problem


def test_bytes_that_are_not_text_are_refused(tmp_path) -> None:
    (tmp_path / META_FILE).write_bytes(b"\xff\xfe{}")
    with pytest.raises(DataError, match="meta.json is not text"):
        load_meta(tmp_path)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from([*FIELDS, "unknown"]), value=json_values,
       drop=st.booleans())
def test_fuzz_any_value_in_any_field_is_read_or_refused_cleanly(field, value, drop) -> None:
    raw = _valid()
    if drop and field in raw:
        del raw[field]
    else:
        raw[field] = value
    try:
        meta = parse_meta(json.loads(json.dumps(raw)), "meta.json")
    except DataError as err:
        assert "meta.json" in err.problem and err.fix
        return
    _well_typed(meta)


@settings(max_examples=200, deadline=None)
@given(feature=st.dictionaries(st.sampled_from(["name", "vocab_size", "multi_hot", "x"]),
                               json_values, max_size=4))
def test_fuzz_any_sparse_feature_is_read_or_refused_cleanly(feature) -> None:
    raw = _valid()
    raw["sparse_features"] = [feature]
    try:
        meta = parse_meta(raw, "meta.json")
    except GemError as err:
        assert "sparse_features[0]" in err.problem
        return
    _well_typed(meta)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40) | st.binary(max_size=40).map(lambda b: b.decode("latin-1")))
def test_fuzz_any_text_is_read_or_refused_cleanly(text) -> None:
    from gem_platform.data.meta import parse_meta_text

    try:
        _well_typed(parse_meta_text(text, "meta.json"))
    except DataError as err:
        assert "meta.json" in err.problem


def test_submit_on_a_dataset_with_a_non_numeric_field_exits_2(gemctl, tiny_dataset, tmp_path,
                                                              monkeypatch) -> None:
    copy = tmp_path / "ds"
    copy.mkdir()
    for p in tiny_dataset.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    raw = json.loads((copy / META_FILE).read_text())
    raw["num_train"] = "abc"
    (copy / META_FILE).write_text(json.dumps(raw))
    monkeypatch.chdir(tmp_path)
    for command in (["submit", str(REPO / "recipes/demo.yaml"), "--local"],
                    ["plan", str(REPO / "recipes/demo.yaml")]):
        result = gemctl(*command, "--set", "data.source=parquet", "--set", f"data.path={copy}")
        refused(result, "field 'num_train' is 'abc'", "Regenerate the dataset")
