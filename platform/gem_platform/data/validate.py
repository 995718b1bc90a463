"""Rows of a shard, checked against the dataset's meta.json and turned into flat arrays.

Every bad value raises ``DataError`` naming the file, the row (counted from the start of the
file) and the column. A history longer than ``meta.max_seq_len`` is an error too, unless the
caller asks to truncate it to its newest ``max_seq_len`` events (``truncate=True``); truncated
rows are counted in ``SampleArrays.truncated_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from gem_platform.data.arrays import SampleArrays
from gem_platform.data.meta import DatasetMeta
from gem_platform.errors import DataError

SPARSE_PREFIX = "sparse__"


def sparse_column(name: str) -> str:
    return SPARSE_PREFIX + name


class _Checker:
    """Turns the first bad value of a column into a DataError naming file, row and column."""

    def __init__(self, file: Path | str, first_row: int) -> None:
        self.file = file
        self.first_row = first_row

    def fail(self, row: int | None, column: str, what: str,
             fix: str = "Fix the file that produced this shard or regenerate the dataset."
             ) -> DataError:
        where = f"{self.file}" if row is None else f"{self.file}, row {self.first_row + row}"
        return DataError(f"{where}, column {column!r}: {what}.", fix)

    def column(self, table: pa.Table, name: str, typ: pa.DataType) -> pa.Array:
        if name not in table.column_names:
            raise self.fail(None, name, f"missing column (the file has {table.column_names})")
        col = table.column(name).combine_chunks()
        if col.null_count:
            row = int(np.flatnonzero(np.asarray(col.is_null()))[0])
            raise self.fail(row, name, "null value")
        if col.type != typ:
            try:
                col = col.cast(typ)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise self.fail(None, name, f"type {col.type} where {typ} is expected ({e})") from e
        return col

    def scalar(self, table: pa.Table, name: str, typ: pa.DataType) -> np.ndarray:
        return self.column(table, name, typ).to_numpy(zero_copy_only=False)

    def jagged(self, table: pa.Table, name: str, value_type: pa.DataType
               ) -> tuple[np.ndarray, np.ndarray]:
        col = self.column(table, name, pa.list_(value_type))
        offsets = np.asarray(col.offsets, dtype=np.int64)
        offsets = offsets - offsets[0]
        flat = col.flatten()
        if flat.null_count:
            pos = int(np.flatnonzero(np.asarray(flat.is_null()))[0])
            raise self.fail(self.row_of(offsets, pos), name, "null element in the list")
        return offsets, flat.to_numpy(zero_copy_only=False)

    @staticmethod
    def row_of(offsets: np.ndarray, position: int) -> int:
        return int(np.searchsorted(offsets, position, side="right") - 1)

    def in_range(
        self, values: np.ndarray, offsets: np.ndarray | None, name: str, lo: int, hi: int
    ) -> None:
        """All ``values`` in ``[lo, hi)``; ``offsets`` maps positions to rows for lists."""
        bad = np.flatnonzero((values < lo) | (values >= hi))
        if bad.size:
            pos = int(bad[0])
            row = pos if offsets is None else self.row_of(offsets, pos)
            raise self.fail(row, name, f"value {values[pos]} outside [{lo}, {hi})")

    def history_list(self, table: pa.Table, name: str, typ: pa.DataType,
                     seq_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A per-event list column whose list lengths must equal ``seq_len``."""
        off, vals = self.jagged(table, name, typ)
        mismatch = np.flatnonzero(np.diff(off) != seq_len)
        if mismatch.size:
            r = int(mismatch[0])
            raise self.fail(r, name,
                            f"list length {off[r + 1] - off[r]} but seq_len is {seq_len[r]}")
        return off, vals


@dataclass
class _History:
    """The per-event columns of a set of rows (oldest event first)."""

    offsets: np.ndarray
    items: np.ndarray
    actions: np.ndarray
    age: np.ndarray
    categories: np.ndarray | None

    def newest(self, limit: int) -> tuple[_History, int]:
        """Each history cut to its newest ``limit`` events, and how many rows were cut."""
        lengths = np.diff(self.offsets)
        cut = int((lengths > limit).sum())
        if not cut:
            return self, 0
        keep = np.minimum(lengths, limit)
        starts = self.offsets[:-1] + (lengths - keep)
        offsets = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(keep, out=offsets[1:])
        pos = np.arange(int(offsets[-1]), dtype=np.int64) + np.repeat(starts - offsets[:-1], keep)
        cats = None if self.categories is None else self.categories[pos]
        return _History(offsets, self.items[pos], self.actions[pos], self.age[pos], cats), cut


def _seq_len(ck: _Checker, table: pa.Table, meta: DatasetMeta, truncate: bool) -> np.ndarray:
    """The history lengths, checked against ``meta.max_seq_len`` before any list is read."""
    seq_len = ck.scalar(table, "seq_len", pa.int32()).astype(np.int64)
    neg = np.flatnonzero(seq_len < 0)
    if neg.size:
        raise ck.fail(int(neg[0]), "seq_len", f"negative history length {seq_len[neg[0]]}")
    limit = meta.max_seq_len
    if limit > 0 and not truncate:
        over = np.flatnonzero(seq_len > limit)
        if over.size:
            r = int(over[0])
            raise ck.fail(
                r, "seq_len",
                f"history of {seq_len[r]} events, longer than the dataset's max_seq_len {limit} "
                "(meta.json)",
                "Fix or drop the row, or set data.history_overflow: truncate in the recipe to "
                "keep each over-long history's newest max_seq_len events.")
    return seq_len


def _history(ck: _Checker, table: pa.Table, meta: DatasetMeta, seq_len: np.ndarray
             ) -> _History:
    offsets, items = ck.history_list(table, "seq_item_ids", pa.int64(), seq_len)
    ck.in_range(items, offsets, "seq_item_ids", 1, meta.num_items + 1)
    _, actions = ck.history_list(table, "seq_action_types", pa.int32(), seq_len)
    actions = actions.astype(np.int64)
    ck.in_range(actions, offsets, "seq_action_types", 0, meta.num_action_types)
    _, age = ck.history_list(table, "seq_age", pa.float32(), seq_len)
    age = age.astype(np.float32, copy=False)
    bad = np.flatnonzero(~np.isfinite(age) | (age < 0))
    if bad.size:
        raise ck.fail(ck.row_of(offsets, int(bad[0])), "seq_age",
                      f"age {age[bad[0]]} is not a finite value >= 0")
    categories = None
    if meta.num_categories:
        _, categories = ck.history_list(table, "seq_item_categories", pa.int64(), seq_len)
        ck.in_range(categories, offsets, "seq_item_categories", 0, meta.num_categories)
        categories = categories.astype(np.int64, copy=False)
    return _History(offsets, items.astype(np.int64, copy=False), actions, age, categories)


def _sparse(ck: _Checker, table: pa.Table, meta: DatasetMeta, n: int
            ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    values, offsets = {}, {}
    for spec in meta.sparse_features:
        col = sparse_column(spec.name)
        if spec.multi_hot:
            off, vals = ck.jagged(table, col, pa.int64())
        else:
            vals, off = ck.scalar(table, col, pa.int64()), np.arange(n + 1, dtype=np.int64)
        ck.in_range(vals, off if spec.multi_hot else None, col, 0, spec.vocab_size)
        values[spec.name] = vals.astype(np.int64, copy=False)
        offsets[spec.name] = off
    return values, offsets


def _dense(ck: _Checker, table: pa.Table, meta: DatasetMeta, n: int) -> np.ndarray:
    d_off, d_vals = ck.jagged(table, "dense", pa.float32())
    wrong = np.flatnonzero(np.diff(d_off) != meta.dense_dim)
    if wrong.size:
        r = int(wrong[0])
        raise ck.fail(
            r, "dense", f"{d_off[r + 1] - d_off[r]} values where dense_dim is {meta.dense_dim}"
        )
    nonfinite = np.flatnonzero(~np.isfinite(d_vals))
    if nonfinite.size:
        raise ck.fail(ck.row_of(d_off, int(nonfinite[0])), "dense", "non-finite value")
    return d_vals.astype(np.float32, copy=False).reshape(n, meta.dense_dim)


def _labels(ck: _Checker, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    ctr = ck.scalar(table, "ctr", pa.int8())
    cvr = ck.scalar(table, "cvr", pa.int8())
    for name, lab in (("ctr", ctr), ("cvr", cvr)):
        ck.in_range(lab, None, name, 0, 2)
    cvr_without_click = np.flatnonzero((cvr == 1) & (ctr == 0))
    if cvr_without_click.size:
        raise ck.fail(int(cvr_without_click[0]), "cvr",
                      "conversion (cvr=1) on a sample that was not clicked (ctr=0)")
    return ctr.astype(np.int8, copy=False), cvr.astype(np.int8, copy=False)


def from_arrow(table: pa.Table, meta: DatasetMeta, file: Path | str, first_row: int = 0,
               *, truncate: bool = False) -> SampleArrays:
    """Validate rows of a shard against ``meta`` and turn them into flat arrays.

    ``first_row`` is the file row of ``table``'s first row (for messages). Histories longer
    than ``meta.max_seq_len`` (when it is set) raise, or with ``truncate`` keep their newest
    ``max_seq_len`` events.
    """
    ck = _Checker(file, first_row)
    seq_len = _seq_len(ck, table, meta, truncate)
    history = _history(ck, table, meta, seq_len)
    cut = 0
    if truncate and meta.max_seq_len > 0:
        history, cut = history.newest(meta.max_seq_len)
    ad = ck.scalar(table, "ad_item_id", pa.int64())
    ck.in_range(ad, None, "ad_item_id", 1, meta.num_items + 1)
    ad_category = None
    if meta.num_categories:
        ad_category = ck.scalar(table, "ad_category", pa.int64())
        ck.in_range(ad_category, None, "ad_category", 0, meta.num_categories)
        ad_category = ad_category.astype(np.int64, copy=False)
    n = len(seq_len)
    sparse_values, sparse_offsets = _sparse(ck, table, meta, n)
    dense = _dense(ck, table, meta, n)
    ctr, cvr = _labels(ck, table)
    return SampleArrays(
        seq_offsets=history.offsets,
        seq_item_ids=history.items,
        seq_action_types=history.actions,
        seq_age=history.age,
        ad_item_id=ad.astype(np.int64, copy=False),
        sparse_values=sparse_values,
        sparse_offsets=sparse_offsets,
        dense=dense,
        ctr=ctr,
        cvr=cvr,
        seq_item_categories=history.categories,
        ad_category=ad_category,
        truncated_rows=cut,
    )


__all__ = ["from_arrow", "sparse_column"]
