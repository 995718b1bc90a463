"""The in-memory form of samples: flat numpy arrays plus offsets, and jagged gathers.

Shared by the Parquet reader, the validator, the writers and the collate step, so none of them
imports another to get at the arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class SampleArrays:
    """N samples as flat numpy arrays plus offsets: the in-memory form of a shard.

    ``sparse_offsets[name]`` is ``(N+1,)`` for every feature (``arange`` for single-hot ones),
    so single- and multi-hot features are handled alike. ``seq_item_categories`` and
    ``ad_category`` are both set when items carry a category, both None otherwise.
    """

    seq_offsets: np.ndarray  # (N+1,) int64
    seq_item_ids: np.ndarray  # (T,) int64
    seq_action_types: np.ndarray  # (T,) int64
    seq_age: np.ndarray  # (T,) float32
    ad_item_id: np.ndarray  # (N,) int64
    sparse_values: dict[str, np.ndarray]  # name -> int64 ids
    sparse_offsets: dict[str, np.ndarray]  # name -> (N+1,) int64
    dense: np.ndarray  # (N, D) float32
    ctr: np.ndarray  # (N,) int8
    cvr: np.ndarray  # (N,) int8
    seq_item_categories: np.ndarray | None = None  # (T,) int64
    ad_category: np.ndarray | None = None  # (N,) int64
    # Histories cut to the dataset's max_seq_len while these rows were read (newest kept).
    truncated_rows: int = 0

    @property
    def has_categories(self) -> bool:
        return self.seq_item_categories is not None

    def __len__(self) -> int:
        return int(self.seq_offsets.shape[0] - 1)

    @property
    def seq_lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)

    def slice(self, start: int, stop: int) -> SampleArrays:
        """Rows ``start:stop`` (copies nothing but the rebased offsets)."""
        s0, s1 = int(self.seq_offsets[start]), int(self.seq_offsets[stop])
        sv, so = {}, {}
        for name, off in self.sparse_offsets.items():
            a, b = int(off[start]), int(off[stop])
            sv[name] = self.sparse_values[name][a:b]
            so[name] = off[start : stop + 1] - a
        return SampleArrays(
            seq_offsets=self.seq_offsets[start : stop + 1] - s0,
            seq_item_ids=self.seq_item_ids[s0:s1],
            seq_action_types=self.seq_action_types[s0:s1],
            seq_age=self.seq_age[s0:s1],
            ad_item_id=self.ad_item_id[start:stop],
            sparse_values=sv,
            sparse_offsets=so,
            dense=self.dense[start:stop],
            ctr=self.ctr[start:stop],
            cvr=self.cvr[start:stop],
            seq_item_categories=_maybe(self.seq_item_categories, slice(s0, s1)),
            ad_category=_maybe(self.ad_category, slice(start, stop)),
        )

    @staticmethod
    def concat(parts: Sequence[SampleArrays]) -> SampleArrays:
        if len(parts) == 1:
            return parts[0]
        names = list(parts[0].sparse_values)
        return SampleArrays(
            seq_offsets=_concat_offsets([p.seq_offsets for p in parts]),
            seq_item_ids=np.concatenate([p.seq_item_ids for p in parts]),
            seq_action_types=np.concatenate([p.seq_action_types for p in parts]),
            seq_age=np.concatenate([p.seq_age for p in parts]),
            ad_item_id=np.concatenate([p.ad_item_id for p in parts]),
            sparse_values={n: np.concatenate([p.sparse_values[n] for p in parts]) for n in names},
            sparse_offsets={
                n: _concat_offsets([p.sparse_offsets[n] for p in parts]) for n in names
            },
            dense=np.concatenate([p.dense for p in parts]),
            ctr=np.concatenate([p.ctr for p in parts]),
            cvr=np.concatenate([p.cvr for p in parts]),
            seq_item_categories=_maybe_concat([p.seq_item_categories for p in parts]),
            ad_category=_maybe_concat([p.ad_category for p in parts]),
            truncated_rows=sum(p.truncated_rows for p in parts),
        )

    def take(self, indices: np.ndarray) -> SampleArrays:
        """Rows ``indices`` (any order, repeats allowed) as new arrays."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        seq_offsets, pos = gather_jagged(self.seq_offsets, idx)
        sv, so = {}, {}
        for name, off in self.sparse_offsets.items():
            so[name], pos_k = gather_jagged(off, idx)
            sv[name] = self.sparse_values[name][pos_k]
        return SampleArrays(
            seq_offsets=seq_offsets,
            seq_item_ids=self.seq_item_ids[pos],
            seq_action_types=self.seq_action_types[pos],
            seq_age=self.seq_age[pos],
            ad_item_id=self.ad_item_id[idx],
            sparse_values=sv,
            sparse_offsets=so,
            dense=self.dense[idx],
            ctr=self.ctr[idx],
            cvr=self.cvr[idx],
            seq_item_categories=_maybe(self.seq_item_categories, pos),
            ad_category=_maybe(self.ad_category, idx),
        )

    def with_history(self, other: SampleArrays, order: np.ndarray) -> SampleArrays:
        """These samples with the histories of ``other``'s rows ``order`` (for ablations)."""
        idx = np.asarray(order, dtype=np.int64)
        offsets, pos = gather_jagged(other.seq_offsets, idx)
        return SampleArrays(
            seq_offsets=offsets,
            seq_item_ids=other.seq_item_ids[pos],
            seq_action_types=other.seq_action_types[pos],
            seq_age=other.seq_age[pos],
            ad_item_id=self.ad_item_id,
            sparse_values=self.sparse_values,
            sparse_offsets=self.sparse_offsets,
            dense=self.dense,
            ctr=self.ctr,
            cvr=self.cvr,
            seq_item_categories=_maybe(other.seq_item_categories, pos),
            ad_category=self.ad_category,
        )


def _maybe(values: np.ndarray | None, index: slice | np.ndarray) -> np.ndarray | None:
    return None if values is None else values[index]


def _maybe_concat(parts: Sequence[np.ndarray | None]) -> np.ndarray | None:
    present = [p is not None for p in parts]
    if not any(present):
        return None
    if not all(present):
        raise ValueError("cannot concatenate samples with and without item categories")
    return np.concatenate(parts)  # type: ignore[arg-type]


def _concat_offsets(parts: Sequence[np.ndarray]) -> np.ndarray:
    out = [np.zeros(1, dtype=np.int64)]
    base = 0
    for off in parts:
        out.append(off[1:] + base)
        base += int(off[-1])
    return np.concatenate(out).astype(np.int64, copy=False)


def gather_jagged(offsets: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """New offsets and flat source positions of the segments ``indices`` (in that order)."""
    starts = offsets[indices]
    lengths = offsets[indices + 1] - starts
    new_offsets = np.zeros(len(indices) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    total = int(new_offsets[-1])
    pos = np.arange(total, dtype=np.int64) + np.repeat(starts - new_offsets[:-1], lengths)
    return new_offsets, pos
