"""The hand-made features on a hand-built batch: every group's indices and weights."""

from __future__ import annotations

import numpy as np
import pytest

from gem_platform.data.arrays import SampleArrays
from gem_platform.data.meta import DatasetMeta, SparseFeatureSpec
from gem_platform.reference import features
from gem_platform.reference.chunks import iter_chunks
from gem_platform.reference.config import LinearReferenceConfig
from gem_platform.reference.features import DenseScale, FeatureLayout, encode

K, A, W = 3, 2, 2  # categories, action types, windows
META = DatasetMeta(source="synthetic", num_items=6, num_action_types=A,
                   sparse_features=[SparseFeatureSpec("user_id", 3),
                                    SparseFeatureSpec("tags", 4, multi_hot=True)],
                   dense_dim=2, num_train=2, num_eval=0, ctr_base_rate=0.5,
                   cvr_base_rate=0.5, num_categories=K)
CFG = LinearReferenceConfig(recent_window=2)
SCALE = DenseScale(mean=np.array([2.0, 1.0]), std=np.array([1.0, 1.0]))


def two_samples() -> SampleArrays:
    """Sample 0: five events (oldest first), candidate item 5 of category 0, tags {1, 3}.
    Sample 1: no history, candidate item 1 of category 1, tag 2 twice."""
    i64 = np.int64
    return SampleArrays(
        seq_offsets=np.array([0, 5, 5], i64),
        seq_item_ids=np.array([1, 2, 3, 4, 5], i64),
        seq_action_types=np.array([0, 1, 0, 1, 1], i64),
        seq_age=np.zeros(5, np.float32),
        ad_item_id=np.array([5, 1], i64),
        sparse_values={"user_id": np.array([2, 0], i64), "tags": np.array([1, 3, 2, 2], i64)},
        sparse_offsets={"user_id": np.array([0, 1, 2], i64), "tags": np.array([0, 2, 4], i64)},
        dense=np.array([[1.0, 2.0], [3.0, 1.0]], np.float32),
        ctr=np.array([1, 0], np.int8), cvr=np.array([0, 0], np.int8),
        seq_item_categories=np.array([0, 1, 1, 2, 0], i64),
        ad_category=np.array([0, 1], i64),
    )


def at(layout: FeatureLayout, group: str, local: int) -> int:
    assert 0 <= local < layout.sizes[group]
    return layout.start(group) + local


def cross(cand: int, hist: int, window: int, action: int) -> int:
    return ((cand * K + hist) * W + window) * A + action


def test_layout_has_every_group_once_and_back_to_back():
    layout = FeatureLayout.for_meta(META, CFG)
    assert layout.sizes == {"ad_item": 7, "ad_category": K, "sparse:user_id": 3,
                            "sparse:tags": 4, "affinity": K * K * W * A,
                            "same_category": W * A, "same_item": W * A,
                            "window_actions": W * A, "history_length": CFG.length_buckets,
                            "dense": 2, "dense_pairs": 3}
    ends = [layout.start(g) + s for g, s in layout.sizes.items()]
    assert [layout.start(g) for g in layout.sizes][1:] == ends[:-1]
    assert layout.size == ends[-1]


def test_sample_with_a_history():
    layout = FeatureLayout.for_meta(META, CFG)
    got = encode(two_samples(), layout, SCALE).row(0)
    third = 1 / 3
    # recent window: events 4 (category 2, action 1) and 5 (category 0, action 1, the
    # candidate item); older window: events 1 (0, 0), 2 (1, 1), 3 (1, 0)
    want = {
        at(layout, "ad_item", 5): 1.0, at(layout, "ad_category", 0): 1.0,
        at(layout, "sparse:user_id", 2): 1.0,
        at(layout, "sparse:tags", 1): 0.5, at(layout, "sparse:tags", 3): 0.5,
        at(layout, "window_actions", 0 * A + 1): 1.0,
        at(layout, "window_actions", 1 * A + 0): 2 * third,
        at(layout, "window_actions", 1 * A + 1): third,
        at(layout, "same_item", 0 * A + 1): 0.5,
        at(layout, "affinity", cross(0, 2, 0, 1)): 0.5,
        at(layout, "affinity", cross(0, 0, 0, 1)): 0.5,
        at(layout, "affinity", cross(0, 0, 1, 0)): third,
        at(layout, "affinity", cross(0, 1, 1, 1)): third,
        at(layout, "affinity", cross(0, 1, 1, 0)): third,
        at(layout, "same_category", 0 * A + 1): 0.5,
        at(layout, "same_category", 1 * A + 0): third,
        at(layout, "history_length", 2): 1.0,  # floor(log2(5 + 1))
        # dense standardized to (-1, 1); then the products (0,0), (0,1), (1,1)
        at(layout, "dense", 0): -1.0, at(layout, "dense", 1): 1.0,
        at(layout, "dense_pairs", 0): 1.0, at(layout, "dense_pairs", 1): -1.0,
        at(layout, "dense_pairs", 2): 1.0,
    }
    assert got.keys() == want.keys()
    for index, weight in want.items():
        assert got[index] == pytest.approx(weight, rel=1e-6), index


def test_sample_without_history_has_ids_length_and_dense_only():
    layout = FeatureLayout.for_meta(META, CFG)
    got = encode(two_samples(), layout, SCALE).row(1)
    want = {
        at(layout, "ad_item", 1): 1.0, at(layout, "ad_category", 1): 1.0,
        at(layout, "sparse:user_id", 0): 1.0, at(layout, "sparse:tags", 2): 1.0,
        at(layout, "history_length", 0): 1.0,
        at(layout, "dense", 0): 1.0, at(layout, "dense", 1): 0.0,
        at(layout, "dense_pairs", 0): 1.0, at(layout, "dense_pairs", 1): 0.0,
        at(layout, "dense_pairs", 2): 0.0,
    }
    assert {i: pytest.approx(w) for i, w in got.items()} == want


def test_data_without_categories_has_no_category_groups():
    meta = DatasetMeta(**{**META.__dict__, "num_categories": 0})
    layout = FeatureLayout.for_meta(meta, CFG)
    assert not {"ad_category", "affinity", "same_category"} & layout.sizes.keys()
    arrays = two_samples()
    arrays.seq_item_categories = arrays.ad_category = None
    got = encode(arrays, layout, SCALE).row(0)
    assert got[at(layout, "same_item", 0 * A + 1)] == pytest.approx(0.5)
    assert max(got) < layout.size


def test_bags_do_not_depend_on_the_chunk_or_the_summing_blocks(small_dataset, monkeypatch):
    """A sample's features are the same alone, in a chunk, and summed in many small blocks."""
    path, meta = small_dataset
    layout = FeatureLayout.for_meta(meta, LinearReferenceConfig())
    chunk = next(iter_chunks(path, meta, "train", 300))
    scale = DenseScale.fit(chunk.dense)
    whole = encode(chunk, layout, scale)
    monkeypatch.setattr(features, "BLOCK_CELLS", 1000)  # a handful of samples per block
    blocked = encode(chunk, layout, scale)
    for i in (0, 1, 137, 299):
        alone = encode(chunk.slice(i, i + 1), layout, scale).row(0)
        assert whole.row(i) == pytest.approx(alone)
        assert blocked.row(i) == pytest.approx(alone)
    assert np.array_equal(whole.offsets, blocked.offsets)
    assert whole.indices.min() >= 0 and whole.indices.max() < layout.size


def test_chunks_cover_the_split_in_order_and_bounded(small_dataset):
    path, meta = small_dataset
    sizes = [len(c) for c in iter_chunks(path, meta, "eval", 500)]
    assert sum(sizes) == meta.num_eval and max(sizes) <= 500
