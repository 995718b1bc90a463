"""The reference is computed once per dataset: cached beside it, keyed by the dataset's
digest and the reference's version, written atomically, never over a file the platform did
not write."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gem_platform.data.prepare import prepare_dataset
from gem_platform.reference import linear
from gem_platform.reference.cache import REFERENCE_FILE, LinearReference, store
from gem_platform.reference.linear import cached_reference, linear_reference, summary_metrics
from tests.reference.conftest import small_config


@pytest.fixture
def dataset(tmp_path: Path):
    cfg = small_config(tmp_path / "ds", num_samples=3000)
    return cfg.path, prepare_dataset(cfg)


def test_computed_once_then_reused(dataset):
    path, meta = dataset
    first = linear_reference(path, meta)
    assert not first.cached and first.cache_file == str(Path(path) / REFERENCE_FILE)
    again = linear_reference(path, meta)
    assert again.cached and again.reference == first.reference
    assert cached_reference(path) == first.reference
    assert summary_metrics(path, meta) == first.reference.metrics()
    assert set(first.reference.metrics()) == {f"reference/linear/{m}_{t}" for t in ("ctr", "cvr")
                                              for m in ("ne", "auc", "calibration")}
    assert [p.name for p in Path(path).iterdir() if p.name.startswith(".")] == []  # no temp
    forced = linear_reference(path, meta, force=True)
    assert not forced.cached and forced.reference.tasks == first.reference.tasks


def test_keyed_by_the_dataset_digest_and_the_version(dataset, tmp_path, monkeypatch):
    path, meta = dataset
    ours = linear_reference(path, meta).reference
    other_cfg = small_config(tmp_path / "other", num_samples=3000, seed=1)
    other_meta = prepare_dataset(other_cfg)
    shutil.copy(Path(path) / REFERENCE_FILE, Path(other_cfg.path) / REFERENCE_FILE)
    assert cached_reference(other_cfg.path) is None  # another dataset's figures
    theirs = linear_reference(other_cfg.path, other_meta)
    assert not theirs.cached and theirs.reference.dataset_digest != ours.dataset_digest
    saved = json.loads((Path(other_cfg.path) / REFERENCE_FILE).read_text())
    assert saved["dataset_digest"] == theirs.reference.dataset_digest

    monkeypatch.setattr(linear, "VERSION", ours.version + 1)  # the reference changed
    assert cached_reference(path) is None
    bumped = linear_reference(path, meta)
    assert not bumped.cached and bumped.reference.version == ours.version + 1


def test_never_replaces_a_file_it_did_not_write(dataset):
    path, meta = dataset
    foreign = Path(path) / REFERENCE_FILE
    foreign.write_text("my own notes\n")
    out = linear_reference(path, meta)
    assert out.cache_file is None and not out.cached
    assert foreign.read_text() == "my own notes\n"
    assert out.reference.tasks["ctr"]["auc"] > 0.5  # still computed and shown


def test_only_cached_in_a_dataset_directory(tmp_path, dataset):
    path, meta = dataset
    ref = linear_reference(path, meta).reference
    plain = tmp_path / "plain"
    plain.mkdir()
    assert store(plain, ref) is None and list(plain.iterdir()) == []
    assert store("s3://bucket/ds", ref) is None
    assert cached_reference(plain) is None


def test_summary_trains_only_small_datasets_on_demand(dataset, monkeypatch):
    path, meta = dataset
    monkeypatch.setattr(linear, "ON_DEMAND_MAX_TRAIN", meta.num_train - 1)
    assert summary_metrics(path, meta) == {}
    assert not (Path(path) / REFERENCE_FILE).exists()
    monkeypatch.setattr(linear, "ON_DEMAND_MAX_TRAIN", meta.num_train)
    lines: list[str] = []
    metrics = summary_metrics(path, meta, lines.append)
    assert metrics["reference/linear/auc_ctr"] > 0.5 and "linear reference" in lines[0]
    assert LinearReference.from_json((Path(path) / REFERENCE_FILE).read_text()).metrics() \
        == metrics
