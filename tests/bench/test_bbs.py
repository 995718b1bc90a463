"""The simulation benchmark's building blocks on a tiny world (the full run is a command)."""

from __future__ import annotations

import numpy as np

from gem_bench.bbs import long_tailed_lengths, rank_lengths, sim_row, targets
from gem_platform.balance import LoaderConfig


def test_lengths_are_long_tailed_and_clipped() -> None:
    lengths = long_tailed_lengths(100_000, np.random.default_rng(0))
    assert lengths.min() == 16 and lengths.max() == 2048
    assert 110 < np.median(lengths) < 150
    assert lengths.mean() > 1.4 * np.median(lengths)  # the long tail pulls the mean up


def test_sim_row_and_targets() -> None:
    cfg = LoaderConfig(local_batch_size=256, base_batch_size=32, buffer_full_batches=8)
    data = rank_lengths(16, 8 * 256, seed=0)
    row = sim_row(data, 8, cfg)
    assert row.world == 16 and row.steps == 8
    assert row.global_ is not None and row.global_ < row.bbs < row.none
    checks = targets([row], {"bbs_ms_per_full_batch": 0.2})
    assert checks["batcher_under_1ms_per_full_batch"]["met"]
    share = checks["bbs_reaches_90pct_of_global_gain"]["share"]
    assert share == row.share_of_global_gain
    assert checks["bbs_reaches_90pct_of_global_gain"]["met"] == (share >= 0.9)
