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
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torchrec import KeyedJaggedTensor

from gem_platform.data.arrays import SampleArrays, gather_jagged
from gem_platform.data.batch import JaggedBatch
from gem_platform.data.meta import META_FILE, DatasetMeta, SparseFeatureSpec
from gem_platform.data.source import (
    SPLITS,
    SplitIndex,
    is_remote,
    open_parquet,
    piece_starts,
    read_meta,
    read_piece,
)
from gem_platform.data.validate import SPARSE_PREFIX, from_arrow, sparse_column
from gem_platform.errors import DataError

# Re-exported: the arrays and the validator used to live here.
__all__ = ["SPARSE_PREFIX", "SampleArrays", "SampleTable", "from_arrow", "gather_jagged",
           "load_meta", "read_share", "sparse_column", "to_arrow", "write_shard", "write_split"]
SEQ_LIST_COLUMNS: tuple[str, ...] = ("seq_item_ids", "seq_action_types", "seq_age")
CATEGORY_COLUMNS: tuple[str, ...] = ("seq_item_categories", "ad_category")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.parquet"


def arrow_schema(
    sparse_features: Sequence[SparseFeatureSpec], categories: bool = False
) -> pa.Schema:
    """The schema every shard of a dataset with these sparse features must have
    (``categories``: items carry a category)."""
    fields = [
        pa.field("seq_len", pa.int32(), nullable=False),
        pa.field("seq_item_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("seq_action_types", pa.list_(pa.int32()), nullable=False),
        pa.field("seq_age", pa.list_(pa.float32()), nullable=False),
        pa.field("ad_item_id", pa.int64(), nullable=False),
    ]
    if categories:
        fields += [
            pa.field("seq_item_categories", pa.list_(pa.int64()), nullable=False),
            pa.field("ad_category", pa.int64(), nullable=False),
        ]
    for spec in sparse_features:
        typ = pa.list_(pa.int64()) if spec.multi_hot else pa.int64()
        fields.append(pa.field(sparse_column(spec.name), typ, nullable=False))
    fields += [
        pa.field("dense", pa.list_(pa.float32()), nullable=False),
        pa.field("ctr", pa.int8(), nullable=False),
        pa.field("cvr", pa.int8(), nullable=False),
    ]
    return pa.schema(fields)


# ----------------------------------------------------------------------------- writing


def _list_array(offsets: np.ndarray, values: np.ndarray, typ: pa.DataType) -> pa.Array:
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32), type=pa.int32()), pa.array(values, type=typ)
    )


def to_arrow(arrays: SampleArrays, sparse_features: Sequence[SparseFeatureSpec]) -> pa.Table:
    n = len(arrays)
    dense_dim = arrays.dense.shape[1] if arrays.dense.ndim == 2 else 0
    cols: list[pa.Array] = [
        pa.array(arrays.seq_lengths.astype(np.int32), type=pa.int32()),
        _list_array(arrays.seq_offsets, arrays.seq_item_ids.astype(np.int64), pa.int64()),
        _list_array(arrays.seq_offsets, arrays.seq_action_types.astype(np.int32), pa.int32()),
        _list_array(arrays.seq_offsets, arrays.seq_age.astype(np.float32), pa.float32()),
        pa.array(arrays.ad_item_id.astype(np.int64), type=pa.int64()),
    ]
    if arrays.has_categories:
        seq_cats = arrays.seq_item_categories.astype(np.int64)
        cols += [
            _list_array(arrays.seq_offsets, seq_cats, pa.int64()),
            pa.array(arrays.ad_category.astype(np.int64), type=pa.int64()),
        ]
    for spec in sparse_features:
        values = arrays.sparse_values[spec.name].astype(np.int64)
        if spec.multi_hot:
            cols.append(_list_array(arrays.sparse_offsets[spec.name], values, pa.int64()))
        else:
            cols.append(pa.array(values, type=pa.int64()))
    dense_offsets = np.arange(n + 1, dtype=np.int64) * dense_dim
    cols += [
        _list_array(dense_offsets, arrays.dense.reshape(-1).astype(np.float32), pa.float32()),
        pa.array(arrays.ctr.astype(np.int8), type=pa.int8()),
        pa.array(arrays.cvr.astype(np.int8), type=pa.int8()),
    ]
    return pa.Table.from_arrays(
        cols, schema=arrow_schema(sparse_features, categories=arrays.has_categories)
    )


def write_shard(
    path: str | Path, arrays: SampleArrays, sparse_features: Sequence[SparseFeatureSpec]
) -> Path:
    """Write one shard; the bytes depend only on the arrays (no timestamps)."""
    path = Path(path)
    pq.write_table(to_arrow(arrays, sparse_features), path, compression="zstd")
    return path


def write_split(
    directory: str | Path,
    split: str,
    arrays: SampleArrays,
    sparse_features: Sequence[SparseFeatureSpec],
    rows_per_shard: int,
) -> list[Path]:
    """Cut ``arrays`` into shards of ``rows_per_shard`` rows named ``<split>-XXXXX.parquet``."""
    out = []
    for i, start in enumerate(range(0, max(len(arrays), 1), rows_per_shard)):
        stop = min(start + rows_per_shard, len(arrays))
        out.append(
            write_shard(
                Path(directory) / shard_name(split, i), arrays.slice(start, stop), sparse_features
            )
        )
    return out


# ----------------------------------------------------------------------------- reading


def load_meta(path: str | Path) -> DatasetMeta:
    """meta.json of a dataset directory (or object-store URI), or a DataError saying how to
    get one."""
    if is_remote(str(path)):
        return read_meta(str(path))
    directory = Path(path)
    try:
        present = directory.is_dir()
    except OSError as e:  # a name too long, a loop of links, no permission
        raise DataError(f"Dataset directory {str(directory)!r} can't be read: {e.strerror}.",
                        "Fix data.path in the recipe.") from None
    if not present:
        raise DataError(
            f"Dataset directory {str(directory)!r} does not exist.",
            "Generate it (data.source: synthetic writes it on first use, or run the MovieLens "
            "converter) or fix data.path in the recipe.",
        )
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise DataError(
            f"{meta_path} is missing: {str(directory)!r} is not a dataset directory.",
            "Point data.path at a directory written by the synthetic generator or the "
            "MovieLens converter, or regenerate it.",
        )
    try:
        return DatasetMeta.load(directory)
    except OSError as e:
        raise DataError(f"Can't read {meta_path}: {e.strerror}.",
                        "Check the file's permissions or fix data.path.") from None


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
