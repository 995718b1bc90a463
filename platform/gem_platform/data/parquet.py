"""Dataset on disk: Parquet shards (one row per sample) plus meta.json, and reading them back.

Layout of a dataset directory::

    meta.json                 DatasetMeta (vocabularies, feature names, base rates, ...)
    train-00000.parquet ...   training shards
    eval-00000.parquet ...    evaluation shards

Columns of every shard (``sparse__<name>`` once per feature, in ``meta.sparse_features``
order): ``seq_len`` int32 (history length, stored so a reader can plan batches from one small
column), ``seq_item_ids`` list<int64>, ``seq_action_types`` list<int32>, ``seq_age``
list<float32> (oldest event first), ``ad_item_id`` int64, ``sparse__<name>`` int64 (single-hot)
or list<int64> (multi-hot), ``dense`` list<float32> of ``dense_dim``, ``ctr`` and ``cvr`` int8.
Datasets whose items carry a category (``meta.num_categories > 0``) also hold
``seq_item_categories`` list<int64> (the category of every history event) and ``ad_category``
int64 (the candidate's).

Everything read is validated: a bad value raises ``DataError`` naming the file and row.
Writing shards and reading meta.json live in shards.py (no torch); this module reads rows back
as tables and batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from torchrec import KeyedJaggedTensor

from gem_platform.data.arrays import SampleArrays, gather_jagged
from gem_platform.data.batch import JaggedBatch
from gem_platform.data.meta import DatasetMeta
from gem_platform.data.shards import (
    arrow_schema,
    load_meta,
    shard_name,
    to_arrow,
    write_shard,
    write_split,
)
from gem_platform.data.source import SPLITS, SplitIndex, open_parquet, piece_starts, read_piece
from gem_platform.data.validate import SPARSE_PREFIX, from_arrow, sparse_column
from gem_platform.errors import DataError

# Re-exported: the arrays, the validator and the writers (shards.py) used to live here.
__all__ = ["SPARSE_PREFIX", "SPLITS", "SampleArrays", "SampleTable", "arrow_schema",
           "from_arrow", "gather_jagged", "load_meta", "read_share", "shard_name",
           "sparse_column", "to_arrow", "write_shard", "write_split"]
SEQ_LIST_COLUMNS: tuple[str, ...] = ("seq_item_ids", "seq_action_types", "seq_age")
CATEGORY_COLUMNS: tuple[str, ...] = ("seq_item_categories", "ad_category")


def read_share(index: SplitIndex, meta: DatasetMeta, rank: int = 0, world_size: int = 1,
               *, truncate: bool = False) -> tuple[SampleArrays, np.ndarray]:
    """Validated rows of ``rank``'s share of a split, and the rank-local first row of each of
    its pieces (row-group slices; see source.py)."""
    pieces = index.share(rank, world_size)
    parts: list[SampleArrays] = []
    handles: dict[str, pq.ParquetFile] = {}
    for piece in pieces:
        name = piece.group.file
        if name not in handles:
            handles = {name: open_parquet(index.fs, name)}  # shards are read one at a time
        table = read_piece(handles[name], piece)
        parts.append(from_arrow(table, meta, name, first_row=piece.file_row, truncate=truncate))
    if not parts:
        return empty_arrays(meta), np.zeros(0, dtype=np.int64)
    return SampleArrays.concat(parts), piece_starts(pieces)


def empty_arrays(meta: DatasetMeta) -> SampleArrays:
    z = np.zeros(1, dtype=np.int64)
    e = np.zeros(0, dtype=np.int64)
    return SampleArrays(
        seq_offsets=z,
        seq_item_ids=e,
        seq_action_types=e,
        seq_age=np.zeros(0, np.float32),
        ad_item_id=e,
        sparse_values={s.name: e for s in meta.sparse_features},
        sparse_offsets={s.name: z for s in meta.sparse_features},
        dense=np.zeros((0, meta.dense_dim), np.float32),
        ctr=np.zeros(0, np.int8),
        cvr=np.zeros(0, np.int8),
        seq_item_categories=e if meta.num_categories else None,
        ad_category=e if meta.num_categories else None,
    )


# ----------------------------------------------------------------------------- the table


class SampleTable:
    """One rank's share of a split, in memory, that cuts any set of rows into a JaggedBatch."""

    def __init__(self, meta: DatasetMeta, arrays: SampleArrays) -> None:
        self.meta = meta
        self.arrays = arrays
        self.seq_lengths: np.ndarray = arrays.seq_lengths.astype(np.int64)
        self._keys = [s.name for s in meta.sparse_features]
        # rank-local first row of each row-group slice (the order a streaming reader uses)
        self.pieces: np.ndarray = np.zeros(1 if len(arrays) else 0, dtype=np.int64)

    @property
    def truncated_rows(self) -> int:
        """Histories that were cut to the dataset's max_seq_len while reading."""
        return self.arrays.truncated_rows

    @classmethod
    def load(cls, path: str | Path, split: str, rank: int = 0, world_size: int = 1,
             *, truncate: bool = False) -> SampleTable:
        """Rank ``rank``'s share of ``split`` ("train" or "eval") of the dataset at ``path``
        (a local directory or an object-store URI). ``truncate``: histories longer than the
        dataset's max_seq_len keep their newest events instead of raising."""
        meta = load_meta(path)
        if split not in SPLITS:
            raise DataError(f"Unknown split {split!r}.", f"Use one of {', '.join(SPLITS)}.")
        expected = meta.num_train if split == "train" else meta.num_eval
        index = SplitIndex.open(str(path), split, expected_rows=expected)
        arrays, pieces = read_share(index, meta, rank, world_size, truncate=truncate)
        table = cls(meta, arrays)
        table.pieces = pieces
        return table

    def __len__(self) -> int:
        return len(self.arrays)

    def collate(self, indices: np.ndarray) -> JaggedBatch:
        """The samples ``indices`` (any order, repeats allowed) as one jagged batch."""
        return collate(self.arrays, indices, self._keys)


def collate(a: SampleArrays, indices: np.ndarray, keys: Sequence[str]) -> JaggedBatch:
    """Rows ``indices`` of ``a`` (any order, repeats allowed) as one jagged batch; ``keys``
    are the sparse features in the dataset's order."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= len(a)):
        raise IndexError(f"indices must be in [0, {len(a)}), got {idx.min()}..{idx.max()}")
    seq_offsets, pos = gather_jagged(a.seq_offsets, idx)
    values, lengths = [], []
    for key in keys:
        off, pos_k = gather_jagged(a.sparse_offsets[key], idx)
        values.append(a.sparse_values[key][pos_k])
        lengths.append(np.diff(off))
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys),
        values=torch.from_numpy(np.concatenate(values) if values else np.zeros(0, np.int64)),
        lengths=torch.from_numpy(np.concatenate(lengths) if lengths else np.zeros(0, np.int64)),
        stride=len(idx),
    )
    labels = np.stack([a.ctr[idx], a.cvr[idx]], axis=1).astype(np.float32)
    categories = {}
    if a.has_categories:
        categories = {
            "seq_item_categories": torch.from_numpy(a.seq_item_categories[pos]),
            "ad_category": torch.from_numpy(a.ad_category[idx]),
        }
    return JaggedBatch(
        seq_offsets=torch.from_numpy(seq_offsets),
        seq_item_ids=torch.from_numpy(a.seq_item_ids[pos]),
        seq_action_types=torch.from_numpy(a.seq_action_types[pos]),
        seq_age=torch.from_numpy(a.seq_age[pos]),
        ad_item_id=torch.from_numpy(a.ad_item_id[idx]),
        sparse=sparse,
        dense=torch.from_numpy(np.ascontiguousarray(a.dense[idx])),
        labels=torch.from_numpy(labels),
        **categories,
    )
