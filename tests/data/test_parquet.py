"""Parquet shards: exact round trip, rank partition and collation into JaggedBatch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gem_platform.data.ownership import Writer
from gem_platform.data.parquet import (
    SampleArrays,
    SampleTable,
    load_meta,
    write_split,
)
from gem_platform.data.staging import staged_dataset
from gem_platform.data.synthetic import PlantedWorld


def test_generated_samples_round_trip_exactly(hand, tmp_path: Path, make_config) -> None:
    syn = make_config(tmp_path).synthetic
    world = PlantedWorld.build(syn)
    rng = np.random.default_rng(3)
    arrays = world.sample(rng, 500)
    world.label(rng, arrays)
    meta = hand.meta(500, num_categories=syn.num_clusters)
    meta.sparse_features = world.sparse_specs
    meta.num_items, meta.num_action_types, meta.dense_dim = (
        syn.num_items,
        syn.num_action_types,
        syn.dense_dim,
    )
    meta.save(tmp_path)
    files = write_split(tmp_path, "train", arrays, world.sparse_specs, rows_per_shard=130)
    assert [f.name for f in files] == [f"train-0000{i}.parquet" for i in range(4)]
    table = SampleTable.load(tmp_path, "train")
    assert len(table) == 500
    hand.assert_same(table.arrays, arrays)
    assert table.seq_lengths.dtype == np.int64
    np.testing.assert_array_equal(table.seq_lengths, np.diff(arrays.seq_offsets))


def _write_uneven(tmp_path: Path, hand) -> SampleArrays:
    lengths = [(i * 7) % 5 for i in range(23)]
    arrays = hand.arrays(lengths, [i % 3 for i in range(23)])
    hand.meta(23).save(tmp_path)
    # Shards of 10, 10 and 3 rows.
    write_split(tmp_path, "train", arrays, hand.specs, rows_per_shard=10)
    return arrays


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 23, 30])
def test_ranks_partition_rows_exactly_once(hand, tmp_path: Path, world_size: int) -> None:
    full = _write_uneven(tmp_path, hand)
    parts = [
        SampleTable.load(tmp_path, "train", rank=r, world_size=world_size).arrays
        for r in range(world_size)
    ]
    sizes = [len(p) for p in parts]
    assert sum(sizes) == 23
    assert max(sizes) - min(sizes) <= 1  # balanced even with fewer shards than ranks
    hand.assert_same(SampleArrays.concat([p for p in parts if len(p)]), full)


def test_rank_outside_world_is_rejected(hand, tmp_path: Path) -> None:
    from gem_platform.errors import DataError

    _write_uneven(tmp_path, hand)
    with pytest.raises(DataError, match="rank 2"):
        SampleTable.load(tmp_path, "train", rank=2, world_size=2)


def test_collate_handles_empty_and_single_event_histories(hand, tmp_path: Path) -> None:
    arrays = hand.arrays([0, 1, 3, 0], [2, 0, 1, 3])
    table = SampleTable(hand.meta(4), arrays)
    batch = table.collate(np.array([2, 0, 1, 3, 2]))
    assert batch.num_samples == 5
    assert batch.seq_offsets.tolist() == [0, 3, 3, 4, 4, 7]
    assert batch.seq_item_ids.tolist() == [3, 3, 3, 2, 3, 3, 3]
    assert batch.seq_age.tolist() == [2.0, 1.0, 0.0, 3.0, 2.0, 1.0, 0.0]
    assert batch.seq_age.dtype == torch.float32
    assert batch.seq_item_ids.dtype == torch.int64
    assert batch.ad_item_id.tolist() == [3, 1, 2, 4, 3]
    assert batch.dense[:, 0].tolist() == [2.0, 0.0, 1.0, 3.0, 2.0]
    assert batch.labels.tolist() == [[0, 0], [0, 0], [1, 1], [1, 0], [0, 0]]
    assert batch.sparse.keys() == ["color", "tags"]
    jt = batch.sparse.to_dict()
    assert jt["color"].lengths().tolist() == [1, 1, 1, 1, 1]
    assert jt["color"].values().tolist() == [2, 0, 1, 3, 2]
    assert jt["tags"].lengths().tolist() == [1, 2, 0, 3, 1]
    assert jt["tags"].values().tolist() == [2, 0, 0, 3, 3, 3, 2]

    only_empty = table.collate(np.array([0]))
    assert only_empty.seq_offsets.tolist() == [0, 0]
    assert only_empty.seq_item_ids.numel() == 0 and only_empty.max_seq_len == 0
    single = table.collate(np.array([1]))
    assert single.seq_offsets.tolist() == [0, 1] and single.seq_item_ids.tolist() == [2]
    nothing = table.collate(np.array([], dtype=np.int64))
    assert nothing.num_samples == 0 and nothing.sparse.stride() == 0

    with pytest.raises(IndexError):
        table.collate(np.array([4]))


def test_collate_of_a_generated_table_matches_its_rows(tiny_dataset: Path) -> None:
    table = SampleTable.load(tiny_dataset, "train", rank=1, world_size=2)
    idx = np.array([5, 0, len(table) - 1])
    batch = table.collate(idx)
    a = table.arrays
    for b, i in enumerate(idx):
        s, e = a.seq_offsets[i], a.seq_offsets[i + 1]
        lo, hi = batch.seq_offsets[b].item(), batch.seq_offsets[b + 1].item()
        assert batch.seq_item_ids[lo:hi].tolist() == a.seq_item_ids[s:e].tolist()
        assert batch.seq_action_types[lo:hi].tolist() == a.seq_action_types[s:e].tolist()
    assert batch.sparse.keys() == [s.name for s in table.meta.sparse_features]
    assert batch.dense.shape == (3, table.meta.dense_dim)


ANY_WRITER = Writer("a test writer", lambda meta: None)  # owns every checked meta.json


def test_failed_write_leaves_the_previous_dataset(tmp_path: Path, hand) -> None:
    out = tmp_path / "ds"
    out.mkdir()
    hand.meta(7).save(out)
    before = (out / "meta.json").read_bytes()
    with pytest.raises(RuntimeError), staged_dataset(out, "output", ANY_WRITER) as tmp:
        (tmp / "train-00000.parquet").write_bytes(b"half")
        raise RuntimeError("crash while writing")
    assert (out / "meta.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    assert sorted(p.name for p in out.iterdir()) == ["meta.json"]

    with staged_dataset(out, "output", ANY_WRITER) as tmp:
        hand.meta(9).save(tmp)
    assert load_meta(out).num_train == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_item_categories_round_trip_and_collate(hand, tmp_path: Path) -> None:
    """Categories travel beside item ids: written, read back and gathered per row."""
    arrays = hand.categorized(hand.arrays([2, 0, 3, 1], [1, 1, 2, 0]))
    hand.meta(4, num_categories=hand.num_categories).save(tmp_path)
    write_split(tmp_path, "train", arrays, hand.specs, rows_per_shard=3)
    table = SampleTable.load(tmp_path, "train")
    hand.assert_same(table.arrays, arrays)
    batch = table.collate(np.array([2, 1, 0]))
    assert batch.seq_item_categories.tolist() == (batch.seq_item_ids % 4).tolist()
    assert batch.ad_category.tolist() == (batch.ad_item_id % 4).tolist()
    assert batch.seq_item_categories.dtype == torch.int64

    # A dataset without categories reads (and collates) without them.
    plain = tmp_path / "plain"
    plain.mkdir()
    hand.meta(4).save(plain)
    write_split(plain, "train", hand.arrays([2, 0, 3, 1], [1, 1, 2, 0]), hand.specs, 3)
    batch = SampleTable.load(plain, "train").collate(np.arange(4))
    assert batch.seq_item_categories is None and batch.ad_category is None
