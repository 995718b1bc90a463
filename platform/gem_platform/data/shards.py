"""Writing a dataset's Parquet shards and reading its meta.json: everything that makes or
finds a dataset without reading its rows into batches, so generating, converting and checking
data (and refusing a dataset that can't fit) never wait for torch to load. The layout and the
columns are described in parquet.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem_platform.data.arrays import SampleArrays
from gem_platform.data.meta import META_FILE, DatasetMeta, SparseFeatureSpec
from gem_platform.data.source import is_remote, read_meta
from gem_platform.data.validate import sparse_column
from gem_platform.errors import DataError


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


__all__ = ["arrow_schema", "load_meta", "shard_name", "to_arrow", "write_shard", "write_split"]
