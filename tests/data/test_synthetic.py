"""Synthetic generator: determinism, reuse, base rates and a history-dependent ground truth."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gem_platform.data.config import SeqLenConfig
from gem_platform.data.parquet import SampleTable, load_meta
from gem_platform.data.prepare import prepare_dataset
from gem_platform.data.synthetic import PlantedWorld, auc, draw_lengths, generate_synthetic
from gem_platform.errors import DataError


def _shard_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_same_seed_gives_byte_identical_dataset(make_config, tmp_path: Path) -> None:
    generate_synthetic(make_config(tmp_path / "a"))
    generate_synthetic(make_config(tmp_path / "b"))
    a, b = _shard_bytes(tmp_path / "a"), _shard_bytes(tmp_path / "b")
    assert set(a) == {
        "meta.json",
        "train-00000.parquet",
        "train-00001.parquet",
        "train-00002.parquet",
        "eval-00000.parquet",
    }
    assert a == b


def test_different_seed_differs(make_config, tmp_path: Path, tiny_dataset: Path) -> None:
    generate_synthetic(make_config(tmp_path / "s1", seed=1))
    t0 = SampleTable.load(tiny_dataset, "train")
    t1 = SampleTable.load(tmp_path / "s1", "train")
    assert not np.array_equal(t0.seq_lengths, t1.seq_lengths)
    assert not np.array_equal(t0.arrays.ad_item_id, t1.arrays.ad_item_id)


def test_reuses_current_dataset_and_regenerates_stale_one(make_config, tmp_path: Path) -> None:
    path = tmp_path / "ds"
    meta = generate_synthetic(make_config(path))
    shard = path / "train-00000.parquet"
    stamp = shard.stat().st_mtime_ns
    assert generate_synthetic(make_config(path)) == meta
    assert shard.stat().st_mtime_ns == stamp  # reused, not rewritten

    changed = generate_synthetic(make_config(path, num_samples=2000))
    assert changed.num_train + changed.num_eval == 2000
    assert changed.extra["config_hash"] != meta.extra["config_hash"]
    assert sorted(p.name for p in path.iterdir()) == [
        "eval-00000.parquet",
        "meta.json",
        "train-00000.parquet",
        "train-00001.parquet",
    ]
    # Nothing temporary is left beside the dataset (only the hidden lock file).
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ds.lock", "ds"]

    generate_synthetic(make_config(path, num_samples=2000), force=True)
    assert shard.stat().st_mtime_ns != stamp


def test_refuses_to_overwrite_a_directory_that_is_not_a_dataset(
    make_config, tmp_path: Path
) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="holds notes.txt, which the synthetic generator did not"):
        generate_synthetic(make_config(tmp_path))
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_label_rates_are_near_the_configured_base_rates(make_config, tmp_path: Path) -> None:
    meta = generate_synthetic(
        make_config(tmp_path, num_samples=12000, ctr_base_rate=0.12, cvr_base_rate=0.25)
    )
    # Binomial std of the rates is ~0.003 (ctr) and ~0.013 (cvr among ~1300 clicks).
    assert meta.ctr_base_rate == pytest.approx(0.12, abs=0.015)
    assert meta.cvr_base_rate == pytest.approx(0.25, abs=0.04)
    table = SampleTable.load(tmp_path, "train")
    assert table.arrays.ctr.mean() == pytest.approx(meta.ctr_base_rate)
    assert np.all(table.arrays.cvr <= table.arrays.ctr)


def test_planted_auc_is_reproducible_and_needs_the_history(make_config, tiny_dataset: Path) -> None:
    meta = load_meta(tiny_dataset)
    cfg = make_config(tiny_dataset)
    world = PlantedWorld.build(cfg.synthetic)
    arrays = SampleTable.load(tiny_dataset, "eval").arrays
    p_ctr, _ = world.probabilities(arrays)
    assert auc(p_ctr, arrays.ctr) == pytest.approx(meta.planted_auc["ctr"])
    assert meta.planted_auc["ctr"] > 0.7
    assert meta.planted_auc["cvr"] > 0.6

    # Same samples, histories dealt to other users: the planted scorer loses most of its edge.
    perm = np.random.default_rng(0).permutation(len(arrays))
    shuffled = arrays.with_history(arrays, perm)
    p_shuffled, _ = world.probabilities(shuffled)
    assert auc(p_shuffled, arrays.ctr) < meta.planted_auc["ctr"] - 0.1

    # Recent and long-ago events each carry signal on their own: scrambling either one hurts.
    n = len(arrays)
    owner = np.repeat(np.arange(n), arrays.seq_lengths)
    from_end = arrays.seq_offsets[owner + 1] - 1 - np.arange(owner.size)
    for scrambled in (from_end < 8, from_end >= 8):
        items = arrays.seq_item_ids.copy()
        items[scrambled] = np.random.default_rng(1).permutation(items[scrambled])
        p, _ = world.probabilities(replace(arrays, seq_item_ids=items))
        assert auc(p, arrays.ctr) < meta.planted_auc["ctr"] - 0.02


def test_degenerate_but_valid_shapes(tmp_path: Path, make_config) -> None:
    cfg = make_config(
        tmp_path,
        num_samples=300,
        dense_dim=0,
        num_action_types=1,
        sparse_features=[],
        seq_len={"mean": 1.0, "sigma": 1.0, "min": 0, "max": 3},
    )
    meta = prepare_dataset(cfg)
    assert [s.name for s in meta.sparse_features] == ["user_id"]
    table = SampleTable.load(tmp_path, "train")
    assert table.seq_lengths.min() == 0 and table.seq_lengths.max() <= 3
    batch = table.collate(np.arange(len(table)))
    assert batch.dense.shape == (len(table), 0)
    assert batch.seq_action_types.unique().tolist() == [0]


def test_length_distributions_respect_bounds() -> None:
    rng = np.random.default_rng(0)
    for dist in ("lognormal", "powerlaw", "fixed"):
        cfg = SeqLenConfig(dist=dist, mean=100, min=16, max=512)
        lengths = draw_lengths(rng, cfg, 20000)
        assert lengths.min() >= 16 and lengths.max() <= 512
        if dist == "fixed":
            assert np.all(lengths == 100)
        else:
            assert lengths.max() > 4 * np.median(lengths)  # long tail
            assert 60 < lengths.mean() < 120


def test_auc_matches_definition() -> None:
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auc(np.array([0.5, 0.5]), np.array([0, 1])) == pytest.approx(0.5)
    assert np.isnan(auc(np.array([0.5, 0.6]), np.array([1, 1])))



def test_items_carry_their_cluster_as_category(make_config, tiny_dataset: Path) -> None:
    """Every event and candidate is written with its item's category (one per item); the
    planted affinity is mostly category agreement plus item-level detail."""
    meta = load_meta(tiny_dataset)
    assert meta.num_categories == meta.extra["num_clusters"]
    a = SampleTable.load(tiny_dataset, "eval").arrays
    assert a.seq_item_categories is not None and a.ad_category is not None
    items = np.concatenate([a.seq_item_ids, a.ad_item_id])
    cats = np.concatenate([a.seq_item_categories, a.ad_category])
    assert cats.min() >= 0 and cats.max() < meta.num_categories
    world = PlantedWorld.build(make_config(tiny_dataset).synthetic)
    np.testing.assert_array_equal(cats, world.item_cluster[items])

    # Item vectors replaced by their category's centroid: most of the edge stays, not all.
    k = meta.num_categories
    centroid = np.zeros((k, world.item_vec.shape[1]))
    np.add.at(centroid, world.item_cluster[1:], world.item_vec[1:])
    centroid /= np.bincount(world.item_cluster[1:], minlength=k)[:, None]
    coarse = replace(world, item_vec=centroid[world.item_cluster].astype(np.float32))
    coarse.item_vec[0] = 0.0
    p_true, _ = world.probabilities(a)
    p_coarse, _ = coarse.probabilities(a)
    ceiling, by_category = auc(p_true, a.ctr), auc(p_coarse, a.ctr)
    assert ceiling - 0.05 < by_category < ceiling
