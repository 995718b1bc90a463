"""Hand-made features for the linear reference, computed from the samples alone.

Every sample becomes a bag of (feature index, weight) pairs into one weight table, laid out
by :class:`FeatureLayout` in groups:

- ``ad_item``, ``ad_category``: one-hot candidate item and category;
- ``sparse:<name>``: one-hot ids of every sparse feature (user id included); a multi-hot
  feature weighs each of its ids 1/count;
- ``affinity``: for each (candidate category, history category, window, action type), the
  fraction of the window's events with that history category and action type, where the
  windows are the last ``recent_window`` events and the older ones. A linear weight per
  entry can express how related two categories are, per window and per action;
- ``same_category``, ``same_item``: per (window, action type), the fraction of the window's
  events in the candidate's category, or on the candidate item itself (shared across
  categories, so they learn from every sample);
- ``window_actions``: per (window, action type), the fraction of the window's events;
- ``history_length``: one-hot log2 bucket of the history length;
- ``dense`` and ``dense_pairs``: the standardized dense features and their pairwise
  products (products only up to ``MAX_PAIRED_DENSE`` features, where they stay cheap).

Datasets whose items carry no category get no ``ad_category``, ``affinity`` or
``same_category`` groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gem_platform.data.arrays import SampleArrays
from gem_platform.data.meta import DatasetMeta
from gem_platform.reference.config import LinearReferenceConfig

WINDOWS = 2  # recent, older
MAX_PAIRED_DENSE = 32
BLOCK_CELLS = 1 << 22  # dense per-sample sums held at once while summing a window


@dataclass(frozen=True)
class FeatureLayout:
    """Where each feature group starts in the weight table, and how wide it is."""

    starts: dict[str, int]
    sizes: dict[str, int]
    num_categories: int
    num_actions: int
    dense_dim: int
    recent_window: int
    length_buckets: int

    @property
    def size(self) -> int:
        return sum(self.sizes.values())

    def start(self, group: str) -> int:
        return self.starts[group]

    def has(self, group: str) -> bool:
        return group in self.starts

    @classmethod
    def for_meta(cls, meta: DatasetMeta, cfg: LinearReferenceConfig) -> FeatureLayout:
        k, a, d = meta.num_categories, meta.num_action_types, meta.dense_dim
        sizes: dict[str, int] = {"ad_item": meta.num_items + 1}
        if k:
            sizes["ad_category"] = k
        for spec in meta.sparse_features:
            sizes[f"sparse:{spec.name}"] = spec.vocab_size
        if k:
            sizes["affinity"] = k * k * WINDOWS * a
            sizes["same_category"] = WINDOWS * a
        sizes["same_item"] = WINDOWS * a
        sizes["window_actions"] = WINDOWS * a
        sizes["history_length"] = cfg.length_buckets
        if d:
            sizes["dense"] = d
        if 0 < d <= MAX_PAIRED_DENSE:
            sizes["dense_pairs"] = d * (d + 1) // 2
        starts, at = {}, 0
        for name, size in sizes.items():
            starts[name] = at
            at += size
        return cls(starts, sizes, k, a, d, cfg.recent_window, cfg.length_buckets)


@dataclass(frozen=True)
class DenseScale:
    """Mean and standard deviation of each dense feature (from training samples)."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, dense: np.ndarray) -> DenseScale:
        values = dense.astype(np.float64)
        std = values.std(axis=0) if len(values) else np.ones(values.shape[1])
        mean = values.mean(axis=0) if len(values) else np.zeros(values.shape[1])
        return cls(mean, np.where(std > 0, std, 1.0))

    def apply(self, dense: np.ndarray) -> np.ndarray:
        return ((dense - self.mean) / self.std).astype(np.float32)


@dataclass
class Bags:
    """Samples as weighted bags: sample i owns ``indices/weights[offsets[i]:offsets[i+1]]``."""

    indices: np.ndarray  # int32 (int64 for tables of 2**31 features or more)
    weights: np.ndarray  # float32
    offsets: np.ndarray  # (n+1,) int64

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    def row(self, i: int) -> dict[int, float]:
        """Sample ``i``'s features as {index: summed weight} (for inspection and tests)."""
        out: dict[int, float] = {}
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        for idx, w in zip(self.indices[a:b].tolist(), self.weights[a:b].tolist(), strict=True):
            out[idx] = out.get(idx, 0.0) + w
        return out


_Part = tuple[np.ndarray, np.ndarray, np.ndarray]  # (sample, feature index, weight)


def _ones(rows: np.ndarray) -> np.ndarray:
    return np.ones(rows.size, dtype=np.float32)


def _id_parts(arrays: SampleArrays, layout: FeatureLayout) -> list[_Part]:
    """One-hot candidate item, candidate category and sparse ids."""
    rows = np.arange(len(arrays), dtype=np.int64)
    parts = [(rows, layout.start("ad_item") + arrays.ad_item_id, _ones(rows))]
    if layout.has("ad_category") and arrays.ad_category is not None:
        parts.append((rows, layout.start("ad_category") + arrays.ad_category, _ones(rows)))
    for name, values in arrays.sparse_values.items():
        lengths = np.diff(arrays.sparse_offsets[name])
        owner = np.repeat(rows, lengths)
        weight = (1.0 / np.maximum(lengths, 1)).astype(np.float32)[owner]
        parts.append((owner, layout.start(f"sparse:{name}") + values, weight))
    return parts


def _per_sample_sums(owner: np.ndarray, local: np.ndarray, weight: np.ndarray, n: int,
                     width: int) -> _Part:
    """Weights summed per (sample, local index in [0, width)), nonzero sums only, by sample.

    ``owner`` is sorted; samples are taken in blocks so a block's dense sums stay small."""
    block = max(1, BLOCK_CELLS // width)
    out_rows, out_local, out_weight = [], [], []
    for first in range(0, n, block):
        last = min(first + block, n)
        a, b = np.searchsorted(owner, [first, last])
        cells = (owner[a:b] - first) * width + local[a:b]
        sums = np.bincount(cells, weights=weight[a:b], minlength=(last - first) * width)
        hit = np.flatnonzero(sums)
        out_rows.append(first + hit // width)
        out_local.append(hit % width)
        out_weight.append(sums[hit].astype(np.float32))
    return (np.concatenate(out_rows), np.concatenate(out_local), np.concatenate(out_weight))


def _history_parts(arrays: SampleArrays, layout: FeatureLayout) -> list[_Part]:
    """Window fractions: action mix, same item, same category and the category cross."""
    n, a = len(arrays), layout.num_actions
    lengths = arrays.seq_lengths
    owner = np.repeat(np.arange(n, dtype=np.int64), lengths)
    from_end = arrays.seq_offsets[owner + 1] - 1 - np.arange(owner.size)
    window = (from_end >= layout.recent_window).astype(np.int64)  # 0 recent, 1 older
    slot = owner * WINDOWS + window
    weight = 1.0 / np.bincount(slot, minlength=WINDOWS * n)[slot]
    wa = window * a + arrays.seq_action_types
    width = WINDOWS * a

    def group(name: str, mask: np.ndarray | None, local: np.ndarray = wa, w: int = width,
              base: np.ndarray | None = None) -> _Part:
        o, loc, wt = ((owner, local, weight) if mask is None
                      else (owner[mask], local[mask], weight[mask]))
        rows, loc, sums = _per_sample_sums(o, loc, wt, n, w)
        offset = layout.start(name) + (0 if base is None else base[rows])
        return rows, offset + loc, sums

    parts = [group("window_actions", None),
             group("same_item", arrays.seq_item_ids == arrays.ad_item_id[owner])]
    if layout.has("affinity") and arrays.seq_item_categories is not None:
        hist, cand = arrays.seq_item_categories, arrays.ad_category
        k = layout.num_categories
        parts.append(group("affinity", None, hist * width + wa, k * width, cand * k * width))
        parts.append(group("same_category", hist == cand[owner]))
    bucket = np.minimum(np.floor(np.log2(lengths + 1.0)).astype(np.int64),
                        layout.length_buckets - 1)
    rows = np.arange(n, dtype=np.int64)
    parts.append((rows, layout.start("history_length") + bucket, _ones(rows)))
    return parts


def _dense_parts(arrays: SampleArrays, layout: FeatureLayout, scale: DenseScale
                 ) -> list[_Part]:
    """Standardized dense values and, where cheap, their pairwise products."""
    if not layout.has("dense"):
        return []
    n, d = len(arrays), layout.dense_dim
    values = scale.apply(arrays.dense)
    cols = [values]
    if layout.has("dense_pairs"):
        i, j = np.triu_indices(d)
        cols.append(values[:, i] * values[:, j])
    block = np.concatenate(cols, axis=1)  # dense_pairs follows dense in the layout
    rows = np.repeat(np.arange(n, dtype=np.int64), block.shape[1])
    index = np.tile(layout.start("dense") + np.arange(block.shape[1], dtype=np.int64), n)
    return [(rows, index, block.reshape(-1).astype(np.float32))]


def encode(arrays: SampleArrays, layout: FeatureLayout, scale: DenseScale) -> Bags:
    """The samples' features as bags, each sample's entries together and in group order."""
    parts = [*_id_parts(arrays, layout), *_history_parts(arrays, layout),
             *_dense_parts(arrays, layout, scale)]
    rows = np.concatenate([p[0] for p in parts])
    order = np.argsort(rows, kind="stable")
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=len(arrays)), out=offsets[1:])
    index_type = np.int32 if layout.size < 2**31 else np.int64  # half the memory when kept
    indices = np.concatenate([p[1] for p in parts]).astype(index_type)[order]
    weights = np.concatenate([p[2] for p in parts]).astype(np.float32, copy=False)[order]
    return Bags(indices, weights, offsets)
