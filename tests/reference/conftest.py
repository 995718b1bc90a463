"""Small synthetic datasets for the linear reference's tests (generated in seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gem_platform.data.config import DataConfig
from gem_platform.data.meta import DatasetMeta
from gem_platform.data.prepare import prepare_dataset


def small_config(path: Path, **synthetic) -> DataConfig:
    """Demo-like data (categories, action types, sparse and dense features), 12k samples."""
    syn = {"num_samples": 12000, "num_users": 300, "num_items": 500, "num_clusters": 10,
           "seq_len": {"mean": 24, "min": 4, "max": 96}, "rows_per_shard": 2000}
    syn.update(synthetic)
    return DataConfig(source="synthetic", path=str(path), synthetic=syn)


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, DatasetMeta]:
    """One generated dataset shared by the tests that only read it."""
    cfg = small_config(tmp_path_factory.mktemp("reference") / "ds")
    return cfg.path, prepare_dataset(cfg)
