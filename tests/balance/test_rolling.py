"""BBS v2 and the shuffle buffer: balance, coverage, determinism, resume, and bad settings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gem_platform.balance import LoaderConfig, LoaderStateError, make_batcher
from gem_platform.balance.cost import sample_work
from gem_platform.balance.rolling import PackingBatcher, pack, piece_order
from gem_platform.balance.stats import straggler_overheads
from gem_platform.errors import DataError


def long_tailed(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(128), 1.0, n), 16, 2048).astype(np.int64)


V2 = LoaderConfig(batching="bbs_v2", local_batch_size=256, window_samples=2048, seed=5)


def test_every_sample_once_per_pass() -> None:
    lengths = long_tailed(3_000)
    batcher = make_batcher(V2, lengths, steps_per_epoch=10, pieces=np.arange(0, 3_000, 300))
    batches = [b for e in range(3) for b in batcher.epoch(e)]  # ~2.6 passes
    assert all(np.unique(b).size == b.size for b in batches)
    taken = np.bincount(np.concatenate(batches), minlength=3_000)
    waiting = np.bincount(batcher.pending, minlength=3_000)
    # every sample has been taken or is waiting as often as the passes read so far
    passes_read = batcher.cursor[0] + 1
    assert np.all(taken + waiting <= passes_read)
    assert np.all(taken + waiting >= passes_read - 1)
    assert np.all(taken >= 1)  # over two passes, nothing is left behind


def test_batches_land_on_the_expected_work() -> None:
    world, steps = 16, 24
    per_rank = [long_tailed(steps * 256 + 500, seed=r) for r in range(world)]
    expected = float(np.mean(np.concatenate(per_rank)))
    work = {"sequential": np.zeros((steps, world)), "bbs_v2": np.zeros((steps, world))}
    for rank, lengths in enumerate(per_rank):
        for batching in work:
            cfg = V2.model_copy(update={"batching": batching, "window_samples": None})
            batcher = make_batcher(cfg, lengths, steps, rank=rank, expected_work=expected) \
                if batching == "bbs_v2" else make_batcher(cfg, lengths, steps, rank=rank)
            work[batching][:, rank] = [lengths[b].sum() for b in batcher.epoch(0)]
    none = straggler_overheads(work["sequential"]).mean()
    v2 = straggler_overheads(work["bbs_v2"]).mean()
    assert none > 0.05 and v2 < 0.01 * none
    # packed batches hold the dataset's expected work per batch
    off = np.abs(work["bbs_v2"] / (256 * expected) - 1)
    assert np.mean(off < 1e-3) >= 0.98 and off.max() < 0.01


def test_deterministic_in_seed_rank_and_epoch() -> None:
    lengths = long_tailed(4_000)
    a = [b.copy() for b in make_batcher(V2, lengths, 8, rank=1).epoch(1)]
    b = [b.copy() for b in make_batcher(V2, lengths, 8, rank=1).epoch(1)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    other_rank = list(make_batcher(V2, lengths, 8, rank=2).epoch(1))
    other_seed = list(make_batcher(V2.model_copy(update={"seed": 6}), lengths, 8,
                                   rank=1).epoch(1))
    assert not np.array_equal(a[0], other_rank[0])
    assert not np.array_equal(a[0], other_seed[0])


@pytest.mark.parametrize("batching", ["bbs_v2", "sequential"])
def test_resume_restores_the_window_without_replay(batching: str) -> None:
    cfg = V2.model_copy(update={"batching": batching})
    lengths = long_tailed(3_000)
    full = [b for e in range(2) for b in make_batcher(cfg, lengths, 10).epoch(e)]
    first = make_batcher(cfg, lengths, 10)
    it = first.epoch(1)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    resumed = make_batcher(cfg, lengths, 10)
    resumed.load_state_dict(state)
    assert np.array_equal(resumed.pending, first.pending)
    rest = list(resumed.epoch(1))
    assert all(np.array_equal(x, y) for x, y in zip(rest, full[13:], strict=True))
    broken = {**state, "window_step": state["window_step"] + 1}
    with pytest.raises(LoaderStateError, match="window"):
        make_batcher(cfg, lengths, 10).load_state_dict(broken)


def test_piece_order_visits_every_piece_once() -> None:
    pieces = np.array([0, 5, 7])
    orders = set()
    for epoch in range(6):
        stream = piece_order(pieces, 12, seed=0, epoch=epoch, rank=1)
        assert sorted(stream.tolist()) == list(range(12))
        # each piece is read front to back in one run: the stream is the pieces, reordered
        cuts = np.flatnonzero(np.diff(stream) != 1) + 1
        runs = {(int(r[0]), int(r[-1]) + 1) for r in np.split(stream, cuts)}
        assert runs <= {(0, 5), (5, 7), (7, 12), (0, 7), (5, 12), (0, 12)}
        orders.add(tuple(stream[np.r_[0, cuts]].tolist()))
    assert len(orders) > 1  # the order changes from pass to pass


@settings(max_examples=50, deadline=None)
@given(m=st.integers(20, 400), frac=st.floats(0.1, 0.5), seed=st.integers(0, 2**16))
def test_pack_takes_b_distinct_entries_near_the_target(m: int, frac: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, m)
    work = sample_work(lengths)
    b = max(1, int(m * frac))
    target = b * work.mean()
    chosen = pack(work, lengths, b, target)
    assert chosen.size == b == np.unique(chosen).size
    assert chosen.min() >= 0 and chosen.max() < m
    # never further from the target than the window's oldest b entries were
    assert abs(work[chosen].sum() - target) <= abs(work[:b].sum() - target) + 1e-9


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValidationError, match="window_samples needs loader.batching 'bbs_v2'"):
        LoaderConfig(batching="bbs", window_samples=4096)
    with pytest.raises(ValidationError, match="must hold at least one local batch"):
        LoaderConfig(batching="bbs_v2", local_batch_size=1024, window_samples=512)
    with pytest.raises(DataError, match="pieces must be ascending"):
        PackingBatcher(V2, long_tailed(3_000), 8, pieces=np.array([0, 10, 5]))
