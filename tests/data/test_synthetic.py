"""Synthetic generator: determinism, reuse, base rates and a history-dependent ground truth."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from gem_platform.data.ceilings import describe_ceilings
from gem_platform.data.config import (
    LONG_RANGE_GAP,
    LONG_RANGE_MIN_LEN,
    RECENT_WINDOW,
    SeqLenConfig,
    SyntheticConfig,
)
from gem_platform.data.parquet import SampleTable, load_meta
from gem_platform.data.prepare import prepare_dataset
from gem_platform.data.synthetic import (
    PlantedWorld,
    _fingerprint,
    _rng,
    auc,
    draw_lengths,
    generate_synthetic,
)
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


# ------------------------------------------------------------------ ceilings and worlds


def _digest(world: PlantedWorld, seed: int) -> str:
    """Hash of two labelled shards of 500 samples, every array of them."""
    h = hashlib.sha256()
    for shard in range(2):
        rng = _rng(seed, 2, shard)
        a = world.sample(rng, 500)
        world.label(rng, a)
        for name in ("seq_offsets", "seq_item_ids", "seq_action_types", "seq_age", "ad_item_id",
                     "dense", "ctr", "cvr", "seq_item_categories", "ad_category"):
            h.update(np.ascontiguousarray(getattr(a, name)).tobytes())
        for key in sorted(a.sparse_values):
            h.update(a.sparse_values[key].tobytes() + a.sparse_offsets[key].tobytes())
    return h.hexdigest()[:16]


def test_standard_world_draws_the_data_it_always_drew(make_config, tmp_path: Path) -> None:
    """The samples, labels and reuse hash of the standard world are those of the generator
    before worlds and term ceilings existed (figures taken from it), so datasets already on
    disk stay current and comparable."""
    syn = make_config(tmp_path).synthetic
    assert syn.world == "standard"
    assert _fingerprint(syn) == "v3-863f331258cd4160"
    assert _digest(PlantedWorld.build(syn), syn.seed) == "b563bef825d6ab53"
    for world in ("local", "long_range"):
        other = make_config(tmp_path, world=world, seq_len={"min": 96, "max": 160}).synthetic
        assert _fingerprint(other) != _fingerprint(replace_world(other, "standard"))


def replace_world(syn: SyntheticConfig, world: str) -> SyntheticConfig:
    return syn.model_copy(update={"world": world})


def test_terms_add_up_to_the_planted_logits(make_config, tiny_dataset: Path) -> None:
    world = PlantedWorld.build(make_config(tiny_dataset).synthetic)
    arrays = SampleTable.load(tiny_dataset, "eval").arrays
    terms = world.terms(arrays)
    z_ctr, z_cvr = world.raw_logits(arrays)
    np.testing.assert_allclose(sum(terms.ctr.values()), z_ctr, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sum(terms.cvr.values()), z_cvr, rtol=1e-12, atol=1e-12)
    assert list(terms.ctr) == ["recent_affinity", "long_affinity", "sparse_ids", "ad_category",
                               "dense", "dense_pair"]


def test_meta_records_each_terms_ceiling(make_config, tiny_dataset: Path) -> None:
    """Each planted term alone carries signal and none reaches the whole scorer's AUC; the
    scorer at category level sits below the item-level ceiling."""
    meta = load_meta(tiny_dataset)
    terms, coarse = meta.extra["term_auc"], meta.extra["category_level_auc"]
    assert set(terms["ctr"]) == {"recent_affinity", "long_affinity", "sparse_ids",
                                 "ad_category", "dense"}
    assert set(terms["cvr"]) == {"intent_affinity", "recent_affinity", "sparse_ids",
                                 "ad_category", "dense"}
    ceiling = meta.planted_auc["ctr"]  # (CVR: ~45 clicked eval samples, too few to order)
    assert all(0.5 < v < ceiling for v in terms["ctr"].values()), terms["ctr"]
    assert ceiling - 0.05 < coarse["ctr"] < ceiling
    assert all(0.0 <= v <= 1.0 for v in [*terms["cvr"].values(), coarse["cvr"]])
    # the figures are those of the eval split's labels, reproducible from the world
    world = PlantedWorld.build(make_config(tiny_dataset).synthetic)
    arrays = SampleTable.load(tiny_dataset, "eval").arrays
    recent = world.terms(arrays).ctr["recent_affinity"]
    assert auc(recent, arrays.ctr) == pytest.approx(terms["ctr"]["recent_affinity"])
    lines = describe_ceilings(meta.planted_auc, meta.extra)
    assert lines[0].startswith(f"ctr: ceiling AUC {meta.planted_auc['ctr']:.3f}, at category "
                               f"level {coarse['ctr']:.3f}; each term alone: recent_affinity")


def test_long_range_world_needs_histories_past_the_gap(make_config, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=f"seq_len.min >= {LONG_RANGE_MIN_LEN}"):
        make_config(tmp_path, world="long_range")
    with pytest.raises(ValidationError, match="world"):
        make_config(tmp_path, world="far")


def _zones(arrays) -> tuple[np.ndarray, np.ndarray]:
    n = len(arrays)
    owner = np.repeat(np.arange(n), arrays.seq_lengths)
    return owner, arrays.seq_offsets[owner + 1] - 1 - np.arange(owner.size)


def test_long_range_signal_needs_a_recent_and_an_old_event_together(
        make_config, tmp_path: Path) -> None:
    """The long-range term reads the recent window against events LONG_RANGE_GAP or more
    positions back: no 64-token block holds both, and neither zone alone tells it."""
    meta = generate_synthetic(make_config(tmp_path, world="long_range", num_samples=4000,
                                          seq_len={"mean": 110, "min": 96, "max": 200}))
    assert meta.extra["world"] == "long_range"
    assert 0.65 < meta.extra["term_auc"]["ctr"]["long_range"] < meta.planted_auc["ctr"]
    arrays = SampleTable.load(tmp_path, "eval").arrays
    world = PlantedWorld.build(make_config(tmp_path, world="long_range",
                                           seq_len={"mean": 110, "min": 96, "max": 200}).synthetic)
    owner, from_end = _zones(arrays)
    recent, old = from_end < RECENT_WINDOW, from_end >= LONG_RANGE_GAP
    assert LONG_RANGE_GAP - RECENT_WINDOW >= 64  # the nearest recent-old pair is 65 apart
    assert np.all(np.bincount(owner[old], minlength=len(arrays)) >= 16)

    def long_range(a) -> float:
        return auc(world.terms(a).ctr["long_range"], arrays.ctr)

    # Old events shuffled across samples (the recent ones kept): the term says nothing.
    items = arrays.seq_item_ids.copy()
    items[old] = np.random.default_rng(0).permutation(items[old])
    assert long_range(replace(arrays, seq_item_ids=items)) < 0.56
    # The middle zone scrambled: the term is unchanged.
    middle = ~recent & ~old
    items = arrays.seq_item_ids.copy()
    items[middle] = np.random.default_rng(1).permutation(items[middle])
    scrambled = world.terms(replace(arrays, seq_item_ids=items)).ctr["long_range"]
    np.testing.assert_array_equal(scrambled, world.terms(arrays).ctr["long_range"])


def test_local_world_reads_only_the_recent_events(make_config, tmp_path: Path) -> None:
    """World local: everything older than the recent window can change without moving the
    planted logits at all."""
    cfg = make_config(tmp_path, world="local", num_samples=2000)
    meta = generate_synthetic(cfg)
    assert set(meta.extra["term_auc"]["ctr"]) == {"recent_affinity", "sparse_ids",
                                                  "ad_category", "dense"}
    world = PlantedWorld.build(cfg.synthetic)
    arrays = SampleTable.load(tmp_path, "eval").arrays
    _, from_end = _zones(arrays)
    older = from_end >= RECENT_WINDOW
    items, actions = arrays.seq_item_ids.copy(), arrays.seq_action_types.copy()
    rng = np.random.default_rng(0)
    items[older], actions[older] = rng.permutation(items[older]), rng.permutation(actions[older])
    moved = replace(arrays, seq_item_ids=items, seq_action_types=actions)
    for a, b in zip(world.raw_logits(arrays), world.raw_logits(moved), strict=True):
        np.testing.assert_array_equal(a, b)
