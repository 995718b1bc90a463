"""The streaming reader: same batches as the in-memory table, bounded memory, exact resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from gem_platform.balance import LoaderConfig, make_batcher
from gem_platform.data.batch import JaggedBatch
from gem_platform.data.loader import expected_work, iterate, open_table
from gem_platform.data.parquet import SampleTable, shard_name, to_arrow
from gem_platform.data.prepare import prepare_dataset
from gem_platform.data.stream import StreamingTable
from gem_platform.data.synthetic import PlantedWorld
from gem_platform.errors import DataError
from tests.data.conftest import tiny_config


def assert_same_batch(a: JaggedBatch, b: JaggedBatch) -> None:
    for name in ("seq_offsets", "seq_item_ids", "seq_action_types", "seq_age", "ad_item_id",
                 "dense", "labels", "seq_item_categories", "ad_category"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name
    assert a.sparse.keys() == b.sparse.keys()
    assert torch.equal(a.sparse.values(), b.sparse.values())
    assert torch.equal(a.sparse.lengths(), b.sparse.lengths())


@pytest.fixture(scope="module")
def many_groups(tmp_path_factory) -> Path:
    """2400 train rows in 3 shards of 4 row groups (200 rows each), plus a small eval split."""
    path = tmp_path_factory.mktemp("groups") / "ds"
    cfg = tiny_config(path, num_samples=2700, eval_fraction=1 / 9, rows_per_shard=800)
    meta = prepare_dataset(cfg)
    world = PlantedWorld.build(cfg.synthetic)
    rng = np.random.default_rng(5)
    for i in range(3):  # rewrite the train shards with 4 row groups each
        arrays = world.sample(rng, 800)
        world.label(rng, arrays)
        pq.write_table(to_arrow(arrays, meta.sparse_features), path / shard_name("train", i),
                       row_group_size=200)
    meta.max_seq_len = cfg.synthetic.seq_len.max  # the rewritten rows' bound
    meta.save(path)
    return path


def _loader(batching: str = "bbs_v2", window: int = 256) -> LoaderConfig:
    return LoaderConfig(batching=batching, local_batch_size=64, window_samples=window,
                        seed=3)


def _run(table, cfg: LoaderConfig, rank: int, steps: int, state: dict | None = None,
         start_epoch: int = 0) -> tuple[list[JaggedBatch], list[np.ndarray], object]:
    batcher = make_batcher(cfg, table.seq_lengths, steps_per_epoch=5, rank=rank,
                           pieces=table.pieces)
    if state is not None:
        batcher.load_state_dict(state)
    it = iterate(table, batcher, start_epoch)
    out, idx = [], []
    for _ in range(steps):
        batch, indices = next(it)
        out.append(batch)
        idx.append(indices)
    it.close()
    return out, idx, batcher


@pytest.mark.parametrize("batching", ["bbs_v2", "sequential"])
def test_streaming_and_in_memory_give_the_same_batches(many_groups: Path, batching: str
                                                       ) -> None:
    cfg = _loader(batching)
    for rank in (0, 1):
        memory = SampleTable.load(str(many_groups), "train", rank, 2)
        stream = open_table(str(many_groups), "train", rank, 2, cfg)
        assert isinstance(stream, StreamingTable)
        assert np.array_equal(memory.pieces, stream.pieces)
        assert np.array_equal(memory.seq_lengths, stream.seq_lengths)
        # 40 steps of ~64 = two passes over the 1200-row share: crosses a pass boundary
        a, ia, _ = _run(memory, cfg, rank, 40)
        b, ib, _ = _run(stream, cfg, rank, 40)
        assert all(np.array_equal(x, y) for x, y in zip(ia, ib, strict=True))
        for x, y in zip(a, b, strict=True):
            assert_same_batch(x, y)
        stream.close()


def test_every_sample_once_per_pass(many_groups: Path) -> None:
    table = open_table(str(many_groups), "train", 0, 1, _loader())
    _, idx, batcher = _run(table, _loader(), 0, 60)
    seen = np.concatenate(idx)
    assert all(np.unique(b).size == b.size for b in idx)
    counts = np.bincount(seen, minlength=len(table))
    # 60 batches of ~64 = 1.6 passes of 2400: every row once, some twice, none more, none
    # left out, and the rows not yet taken twice are exactly the window's
    assert counts.min() >= 1 and counts.max() <= 2
    waiting = np.bincount(batcher.pending, minlength=len(table))
    assert np.all(counts + waiting >= 1)
    table.close()


def test_memory_stays_within_the_window(many_groups: Path) -> None:
    cfg = _loader(window=192)
    table = StreamingTable(str(many_groups), "train", 0, 1, chunk_rows=32, prefetch=2)
    assert len(table) >= 10 * cfg.window_samples
    batcher = make_batcher(cfg, table.seq_lengths, steps_per_epoch=5, pieces=table.pieces)
    it = iterate(table, batcher, 0)
    held = []
    for _ in range(80):  # two passes
        next(it)
        held.append(table.rows_held)
    it.close()
    # the window, plus the chunk being read past it, plus rows kept by partly used chunks
    assert max(held) <= cfg.window_samples + 4 * 32


def test_resume_mid_epoch_is_exact(many_groups: Path) -> None:
    cfg = _loader()
    full = open_table(str(many_groups), "train", 1, 2, cfg)
    expected, expected_idx, _ = _run(full, cfg, 1, 17)
    first = open_table(str(many_groups), "train", 1, 2, cfg)
    _, _, batcher = _run(first, cfg, 1, 7)  # 7 steps: epoch 1, position 2
    state = batcher.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    resumed = open_table(str(many_groups), "train", 1, 2, cfg)
    rest, rest_idx, _ = _run(resumed, cfg, 1, 10, state=state, start_epoch=1)
    assert all(np.array_equal(x, y) for x, y in zip(rest_idx, expected_idx[7:], strict=True))
    for x, y in zip(rest, expected[7:], strict=True):
        assert_same_batch(x, y)
    for t in (full, first, resumed):
        t.close()


def test_expected_work_from_the_length_histogram(many_groups: Path) -> None:
    table = SampleTable.load(str(many_groups), "train")
    cfg = _loader()
    work = expected_work(table.meta, cfg)
    assert work is not None and work > 0  # generated data records its histogram
    meta = table.meta
    meta.extra.pop("seq_len_histogram")
    assert expected_work(meta, cfg) is None


def test_window_needs_a_rolling_batcher(many_groups: Path) -> None:
    table = StreamingTable(str(many_groups), "train")
    batcher = make_batcher(LoaderConfig(batching="sequential", local_batch_size=64),
                           table.seq_lengths)
    with pytest.raises(DataError, match="rolling-window batcher"):
        table.follow(batcher)
