"""A large synthetic dataset's shards are drawn by a pool of processes: the files and the meta
are byte for byte those one process writes."""

from __future__ import annotations

from pathlib import Path

from gem_platform.data.config import SyntheticConfig
from gem_platform.data.synthetic import (
    MIN_POOL_CORES,
    PARALLEL_TOKENS,
    _fingerprint,
    _write_dataset,
    generation_processes,
)

SMALL = {"num_samples": 3000, "rows_per_shard": 400, "num_users": 200, "num_items": 300,
         "world": "long_range", "seq_len": {"dist": "lognormal", "mean": 100, "min": 90,
                                             "max": 140}}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_pool_writes_the_same_bytes_as_one_process(tmp_path: Path) -> None:
    syn = SyntheticConfig.model_validate(SMALL)
    one, pool = tmp_path / "one", tmp_path / "pool"
    one.mkdir()
    pool.mkdir()
    _write_dataset(one, syn, _fingerprint(syn), processes=1)
    _write_dataset(pool, syn, _fingerprint(syn), processes=2)
    written = _files(one)
    assert len([n for n in written if n.endswith(".parquet")]) == 8  # 7 train + 1 eval shards
    assert _files(pool) == written  # every shard and meta.json


def test_only_large_datasets_use_a_pool() -> None:
    small = SyntheticConfig.model_validate(SMALL)
    assert generation_processes(small, 8) == 1
    # twice the threshold's history events (histories of ~100 events)
    large = SyntheticConfig.model_validate({**SMALL, "num_samples": 2 * PARALLEL_TOKENS // 100})
    assert generation_processes(large, 3, cores=16) == 3  # at most one process per shard
    assert generation_processes(large, 40, cores=16) == 16  # at most one per core
    assert generation_processes(large, 40, cores=MIN_POOL_CORES - 1) == 1  # too few cores
    assert generation_processes(small, 8, cores=16) == 1  # too small to pay for a pool
