"""Make a recipe's dataset ready: generate synthetic data when missing or stale, or check that
an existing dataset (local or in object storage) has its meta.json. Kept apart from the
``data`` schema (config.py) so that validating a recipe never reaches the generator."""

from __future__ import annotations

from gem_platform.data.config import DataConfig
from gem_platform.data.meta import DatasetMeta
from gem_platform.data.shards import load_meta
from gem_platform.data.synthetic import generate_synthetic


def prepare_dataset(cfg: DataConfig, *, force: bool = False) -> DatasetMeta:
    """Make sure the dataset of ``cfg`` exists (generating it if synthetic) and return its
    meta. ``force`` regenerates synthetic data even when the directory is current."""
    if cfg.source == "synthetic":
        return generate_synthetic(cfg, force=force)
    return load_meta(cfg.path)
