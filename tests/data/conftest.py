"""Small datasets shared by the data tests (tiny, so the folder stays fast)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gem_platform.data.config import DataConfig
from gem_platform.data.meta import DatasetMeta, SparseFeatureSpec
from gem_platform.data.parquet import SampleArrays
from gem_platform.data.prepare import prepare_dataset


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
    prepare_dataset(tiny_config(path))
    return path


SPECS = [SparseFeatureSpec("color", 5), SparseFeatureSpec("tags", 9, multi_hot=True)]


class Handmade:
    """Tiny hand-built samples whose values encode their row, so a mix-up can't go unnoticed."""

    specs = SPECS

    num_categories = 4

    @staticmethod
    def meta(
        n_train: int, n_eval: int = 0, dense_dim: int = 2, num_categories: int = 0
    ) -> DatasetMeta:
        return DatasetMeta(
            source="synthetic",
            num_items=50,
            num_action_types=3,
            sparse_features=list(SPECS),
            dense_dim=dense_dim,
            num_train=n_train,
            num_eval=n_eval,
            ctr_base_rate=0.5,
            cvr_base_rate=0.5,
            num_categories=num_categories,
        )

    @staticmethod
    def arrays(lengths: list[int], tag_counts: list[int]) -> SampleArrays:
        """Rows with the given history lengths and numbers of ``tags`` ids."""
        n = len(lengths)
        off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        t_off = np.concatenate([[0], np.cumsum(tag_counts)]).astype(np.int64)
        owner = np.repeat(np.arange(n), lengths)
        rows = np.arange(n)
        return SampleArrays(
            seq_offsets=off,
            seq_item_ids=(owner % 50 + 1).astype(np.int64),
            seq_action_types=(np.arange(off[-1]) % 3).astype(np.int64),
            seq_age=np.arange(off[-1], dtype=np.float32)[::-1].copy(),
            ad_item_id=(rows % 50 + 1).astype(np.int64),
            sparse_values={
                "color": rows % 5,
                "tags": np.repeat(rows % 9, tag_counts).astype(np.int64),
            },
            sparse_offsets={"color": np.arange(n + 1), "tags": t_off},
            dense=np.stack([rows, -rows], axis=1).astype(np.float32),
            ctr=(rows % 2).astype(np.int8),
            cvr=((rows % 4) == 1).astype(np.int8),
        )

    @staticmethod
    def categorized(arrays: SampleArrays) -> SampleArrays:
        """The same rows whose items carry a category (item id mod ``num_categories``)."""
        k = Handmade.num_categories
        return replace(
            arrays,
            seq_item_categories=arrays.seq_item_ids % k,
            ad_category=arrays.ad_item_id % k,
        )

    @staticmethod
    def assert_same(a: SampleArrays, b: SampleArrays) -> None:
        for name in (
            "seq_offsets",
            "seq_item_ids",
            "seq_action_types",
            "seq_age",
            "ad_item_id",
            "dense",
            "ctr",
            "cvr",
        ):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        for name in ("seq_item_categories", "ad_category"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                np.testing.assert_array_equal(x, y, err_msg=name)
        assert a.sparse_values.keys() == b.sparse_values.keys()
        for k in a.sparse_values:
            np.testing.assert_array_equal(a.sparse_values[k], b.sparse_values[k], err_msg=k)
            np.testing.assert_array_equal(a.sparse_offsets[k], b.sparse_offsets[k], err_msg=k)


@pytest.fixture
def hand() -> type[Handmade]:
    return Handmade


@pytest.fixture
def gemctl():
    """Run ``gemctl ARGS...`` in this process (typer's CliRunner); returns the click Result."""
    from typer.testing import CliRunner

    from gemctl.main import app

    runner = CliRunner()

    def run(*args: str):
        return runner.invoke(app, list(args), catch_exceptions=True, terminal_width=120,
                             prog_name="gemctl")

    return run


def refused(result, *needles: str) -> str:
    """The command ended with exit code 2 and one paragraph (no traceback) holding every
    needle; returns its stderr."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    text = result.output + result.stderr
    assert "Traceback" not in text
    for needle in needles:
        assert needle in " ".join(text.split()), (needle, text)
    return text
