"""Batchers: conservation, determinism, GEM's pairing example, resume, config validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gem_platform.balance import (
    LoaderConfig,
    LoaderStateError,
    batch_work,
    common_steps_per_epoch,
    make_batcher,
)
from gem_platform.balance.bbs import plan_buffer
from gem_platform.errors import DataError


def long_tailed(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(128), 1.0, n), 16, 2048).astype(np.int64)


def test_gem_worked_example_pairs_to_equal_totals() -> None:
    # 16 base batches of total lengths 16..1 -> 8 pairs of 17 -> 2 full batches of 68.
    cfg = LoaderConfig(base_batch_size=1, local_batch_size=8, buffer_full_batches=2,
                       shuffle=False)
    lengths = np.arange(16, 0, -1)
    batches = list(make_batcher(cfg, lengths).epoch(0))
    assert len(batches) == 2
    assert [int(lengths[b].sum()) for b in batches] == [68, 68]
    for b in batches:
        # each full batch = 4 pairs, each pair summing to 17
        members = sorted(lengths[b].tolist())
        assert [members[i] + members[-1 - i] for i in range(4)] == [17] * 4


def test_worked_example_with_multi_sample_base_batches() -> None:
    # base batches of 2 samples whose totals are 16..1, buffer of 2 full batches of 8
    totals = np.arange(16, 0, -1)
    lengths = np.stack([totals // 2, totals - totals // 2], axis=1).reshape(-1)
    plan = plan_buffer(totals.astype(float), per_full=8)
    assert plan.shape == (2, 8)
    assert sorted(plan.reshape(-1).tolist()) == list(range(16))
    assert totals[plan].sum(axis=1).tolist() == [68, 68]
    cfg = LoaderConfig(base_batch_size=2, local_batch_size=16, buffer_full_batches=2,
                       shuffle=False)
    assert [int(lengths[b].sum()) for b in make_batcher(cfg, lengths).epoch(0)] == [68, 68]


@pytest.mark.parametrize("batching", ["sequential", "bbs"])
@pytest.mark.parametrize("base,local,buffer", [(16, 128, 4), (16, 48, 3), (8, 64, 64)])
def test_every_sample_exactly_once_per_epoch(batching: str, base: int, local: int,
                                             buffer: int) -> None:
    lengths = long_tailed(5_003)
    cfg = LoaderConfig(batching=batching, base_batch_size=base, local_batch_size=local,
                       buffer_full_batches=buffer, seed=3)
    batcher = make_batcher(cfg, lengths, steps_per_epoch=30)
    for epoch in (0, 1):
        batches = list(batcher.epoch(epoch))
        assert len(batches) == len(batcher) == 30
        seen = np.concatenate(batches)
        assert np.array_equal(np.sort(seen), np.arange(lengths.size))
        sizes = {b.size for b in batches}
        assert min(sizes) >= local


def test_drop_last_skips_exactly_the_tail() -> None:
    lengths = long_tailed(1_000)
    cfg = LoaderConfig(base_batch_size=16, local_batch_size=64, buffer_full_batches=4,
                       drop_last=True, seed=1)
    batcher = make_batcher(cfg, lengths)
    assert len(batcher) == 15
    batches = list(batcher.epoch(0))
    assert all(b.size == 64 for b in batches)
    seen = np.concatenate(batches)
    assert np.unique(seen).size == seen.size == 960
    skipped = np.setdiff1d(np.arange(1_000), seen)
    assert np.array_equal(np.sort(batcher.permutation(0)[960:]), skipped)


@pytest.mark.parametrize("batching", ["sequential", "bbs"])
def test_deterministic_per_seed_and_epoch(batching: str) -> None:
    lengths = long_tailed(4_096)
    cfg = LoaderConfig(batching=batching, base_batch_size=32, local_batch_size=256,
                       buffer_full_batches=4, seed=7)
    a = [b.copy() for b in make_batcher(cfg, lengths).epoch(2)]
    b = [b.copy() for b in make_batcher(cfg, lengths).epoch(2)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    other_epoch = list(make_batcher(cfg, lengths).epoch(3))
    assert not np.array_equal(a[0], other_epoch[0])
    other_seed = list(make_batcher(cfg.model_copy(update={"seed": 8}), lengths).epoch(2))
    assert not np.array_equal(a[0], other_seed[0])


@pytest.mark.parametrize("batching", ["sequential", "bbs"])
def test_resume_continues_exactly(batching: str) -> None:
    lengths = long_tailed(3_000)
    cfg = LoaderConfig(batching=batching, base_batch_size=16, local_batch_size=128,
                       buffer_full_batches=5)
    full = list(make_batcher(cfg, lengths).epoch(1))
    first = make_batcher(cfg, lengths)
    it = first.epoch(1)
    for _ in range(7):  # 7 batches trained, then a checkpoint
        next(it)
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 7)
    resumed = make_batcher(cfg, lengths)
    resumed.load_state_dict(state)
    rest = list(resumed.epoch(1))
    assert len(rest) == len(full) - 7
    assert all(np.array_equal(x, y) for x, y in zip(rest, full[7:], strict=True))
    assert len(list(resumed.epoch(2))) == len(full)  # the next epoch starts from 0


def test_resume_rejects_other_data() -> None:
    lengths = long_tailed(3_000)
    cfg = LoaderConfig(base_batch_size=16, local_batch_size=128)
    state = make_batcher(cfg, lengths).state_dict()
    with pytest.raises(LoaderStateError, match="num_samples"):
        make_batcher(cfg, lengths[:2_000]).load_state_dict(state)


def _epoch_work(cfg: LoaderConfig, lengths: np.ndarray) -> np.ndarray:
    return np.array([batch_work(lengths, b, cfg.cost) for b in make_batcher(cfg, lengths).epoch(0)])


def test_bbs_balances_full_batches_within_a_buffer() -> None:
    lengths = long_tailed(64 * 128, seed=5)
    base = LoaderConfig(base_batch_size=64, local_batch_size=512, buffer_full_batches=16)
    for cost in ("length", "attention"):
        seq = _epoch_work(base.model_copy(update={"cost": cost, "batching": "sequential"}),
                          lengths)
        bbs = _epoch_work(base.model_copy(update={"cost": cost}), lengths)
        assert np.isclose(seq.sum(), bbs.sum())
        # BBS spread within each buffer of 16 batches is far below a random split's
        assert bbs.std() < 0.25 * seq.std()


def test_common_steps_uses_global_minimum() -> None:
    assert common_steps_per_epoch([1_000, 999, 5_000], 100) == 9
    with pytest.raises(DataError, match="local_batch_size"):
        common_steps_per_epoch([50, 1_000], 100)
    cfg = LoaderConfig(base_batch_size=10, local_batch_size=100)
    with pytest.raises(DataError, match="steps_per_epoch"):
        make_batcher(cfg, long_tailed(500), steps_per_epoch=6)


def test_config_messages_name_the_field() -> None:
    with pytest.raises(ValidationError, match="local_batch_size .* multiple of .*base_batch"):
        LoaderConfig(local_batch_size=1000, base_batch_size=128)
    with pytest.raises(ValidationError, match="fewer than 2"):
        LoaderConfig(local_batch_size=128, base_batch_size=128)
    with pytest.raises(ValidationError, match="extra"):
        LoaderConfig(local_batch=128)  # type: ignore[call-arg]
    # sequential batching has no base batches to constrain it
    assert LoaderConfig(batching="sequential", local_batch_size=1000).local_batch_size == 1000


@settings(max_examples=60, deadline=None)
@given(
    per_full=st.integers(2, 9),
    fulls=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_plan_buffer_uses_every_base_batch_once(per_full: int, fulls: int, seed: int) -> None:
    work = np.random.default_rng(seed).lognormal(0, 1, per_full * fulls)
    plan = plan_buffer(work, per_full)
    assert plan.shape == (fulls, per_full)
    assert sorted(plan.reshape(-1).tolist()) == list(range(per_full * fulls))
    # round-wise LPT keeps the spread of full-batch totals within one dealt item (a pair,
    # at most twice the heaviest base batch), whatever k / 2 rounds add up to
    totals = work[plan].sum(axis=1)
    assert totals.max() - totals.min() <= 2 * work.max() + 1e-9
