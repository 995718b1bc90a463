"""Small synthetic datasets shared by the data tests (tiny, so the folder stays fast)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gem_platform.data.config import DataConfig


def tiny_config(path: Path, **synthetic) -> DataConfig:
    """A few thousand short histories: generates in well under a second."""
    syn = {
        "num_samples": 3000,
        "num_users": 500,
        "num_items": 2000,
        "num_clusters": 20,
        "seq_len": {"mean": 24, "min": 4, "max": 96},
        "rows_per_shard": 1000,
    }
    syn.update(synthetic)
    return DataConfig(source="synthetic", path=str(path), synthetic=syn)


@pytest.fixture
def make_config():
    """Factory for tiny synthetic configs: ``make_config(path, **synthetic_overrides)``."""
    return tiny_config


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """One generated dataset reused by read-only tests."""
    path = tmp_path_factory.mktemp("tiny") / "ds"
    tiny_config(path).prepare()
    return path
