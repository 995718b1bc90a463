"""The profile report on fixed synthetic datasets: exact figures where they can be derived by
hand, bounds where they are statistical."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gem_platform.balance import LoaderConfig
from gem_platform.balance.partition import balanced_partition, lpt_rounds, partition_loads
from gem_platform.balance.profile import profile_lengths, shard
from gem_platform.errors import DataError, RecipeError


def test_rank_level_imbalance_only_a_global_partition_fixes() -> None:
    # rank 0 holds only length 10, rank 1 only length 30: every step rank 1 does 30/20 = 1.5x
    # the mean. No local reordering helps; repartitioning each step's 2 x 8 samples does.
    per_rank = [np.full(32, 10), np.full(32, 30)]
    cfg = LoaderConfig(base_batch_size=2, local_batch_size=8, buffer_full_batches=4)
    report = profile_lengths(per_rank, world=2, local_batch=8, cfg=cfg)
    assert report.steps == 4
    none, bbs, glob = (report.row(m) for m in ("none", "bbs", "global"))
    assert none.straggler_mean == pytest.approx(0.5)
    assert bbs.straggler_mean == pytest.approx(0.5)
    assert bbs.share_of_global_gain == pytest.approx(0.0)
    assert glob.straggler_max == pytest.approx(0.0)
    assert none.padding_waste == 0.0  # equal lengths inside each rank's batch
    assert glob.padding_waste == pytest.approx(1 - 20 / 30)  # 4 x 10 + 4 x 30 padded to 30
    assert none.rank_work_mean == glob.rank_work_mean == pytest.approx(8 * 20)


def test_gem_example_on_every_rank_balances_exactly() -> None:
    # every rank holds lengths 16..1: BBS (base batch = 1 sample, buffer = 2 full batches of 8)
    # gives every full batch 68, so all ranks are equal at every step
    per_rank = [np.arange(16, 0, -1)] * 4
    cfg = LoaderConfig(base_batch_size=1, local_batch_size=8, buffer_full_batches=2, seed=1)
    report = profile_lengths(per_rank, world=4, local_batch=8, cfg=cfg)
    assert np.all(report.work["bbs"] == 68.0)
    assert report.row("bbs").straggler_max == 0.0
    assert report.row("none").straggler_mean > 0.05
    assert report.row("global").straggler_mean < report.row("none").straggler_mean


def test_long_tailed_figures(tmp_path) -> None:
    rng = np.random.default_rng(42)
    lengths = np.clip(rng.lognormal(np.log(128), 1.0, 32 * 16 * 256), 16, 2048).astype(np.int64)
    cfg = LoaderConfig(base_batch_size=32, local_batch_size=256, buffer_full_batches=16,
                       seed=3)
    report = profile_lengths(lengths, world=32, local_batch=256, cfg=cfg)
    none, bbs, glob = (report.row(m) for m in ("none", "bbs", "global"))
    assert report.steps == 16 and report.work["none"].shape == (16, 32)
    # all three consume the same samples: the same total work
    totals = {m: report.work[m].sum() for m in report.work}
    assert totals["bbs"] == pytest.approx(totals["none"])
    assert totals["global"] == pytest.approx(totals["none"])
    assert totals["none"] == pytest.approx(lengths.sum())
    # sizes of the effect: ~1.31 CV / sqrt(256) spread, max of 32 ranks
    assert 0.10 < none.straggler_mean < 0.30
    assert bbs.straggler_mean < 0.4 * none.straggler_mean
    # BBS sits close to the best any local-only balancer can do with one 16-step buffer
    assert 0.9 * report.local_bound < bbs.straggler_mean < 1.3 * report.local_bound
    assert glob.straggler_mean < 0.005
    assert bbs.share_of_global_gain == pytest.approx(
        (none.straggler_mean - bbs.straggler_mean) / (none.straggler_mean - glob.straggler_mean))
    assert 0.8 < none.padding_waste < 0.95  # 256 samples: the batch max is near 2048
    # the report serializes and draws
    json.dumps(report.to_dict())
    png = report.save_png(tmp_path / "work.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shard_deals_every_sample_once() -> None:
    lengths = np.arange(1_000)
    parts = shard(lengths, world=7)
    assert sorted(np.concatenate(parts).tolist()) == list(range(1_000))
    assert {p.size for p in parts} == {142, 143}


def test_profile_input_errors() -> None:
    cfg = LoaderConfig()
    with pytest.raises(DataError, match="3 ranks"):
        profile_lengths([np.ones(2048)] * 3, world=2, local_batch=1024, cfg=cfg)
    with pytest.raises(RecipeError, match="local batch 1000"):
        profile_lengths(np.ones(4096), world=2, local_batch=1000, cfg=cfg)


def test_lpt_partition_equal_counts() -> None:
    # round-wise dealing balances when no single item is a large share of a part
    rng = np.random.default_rng(0)
    work = rng.lognormal(0, 0.5, 6_400)
    for assign in (lpt_rounds(work, 64)[0], balanced_partition(work, 64)):
        assert np.all(np.bincount(assign, minlength=64) == 100)
        loads = partition_loads(work, assign, 64)
        assert loads.max() / loads.mean() - 1 < 0.01
    # 16..1 into 2 parts of 8: LPT reaches the 68 / 68 optimum
    _, loads = lpt_rounds(np.arange(16, 0, -1), 2)
    assert loads.tolist() == [68.0, 68.0]
