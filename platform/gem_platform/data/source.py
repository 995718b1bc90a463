"""Where a dataset lives: a local directory or an object-store URI (s3://, gs://, hdfs://),
read through pyarrow filesystems, and the index of its Parquet row groups.

A split's rows are numbered in shard order (train-00000 first). Rank ``r`` of ``w`` owns the
contiguous global rows ``total * r // w`` to ``total * (r + 1) // w`` (every row goes to exactly
one rank, even with fewer shards than ranks); its pieces are those rows cut at row-group
boundaries, the unit a reader fetches. Positions inside a rank's share ("rank-local" rows) are
what batchers and tables exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from gem_platform.data.meta import META_FILE, DatasetMeta, parse_meta_text
from gem_platform.data.remote import (
    STORAGE_FIX,
    bounded_on,
    is_network_error,
    open_input,
    open_remote,
    read_failed,
)
from gem_platform.errors import DataError

SPLITS: tuple[str, ...] = ("train", "eval")
REMOTE_SCHEMES: tuple[str, ...] = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")


def is_remote(path: str) -> bool:
    """True for an object-store or HDFS URI (``scheme://...``), False for a local path."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and scheme.lower() in REMOTE_SCHEMES


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of ``path`` and the path inside it.

    Local paths use the local filesystem; URIs go through ``pyarrow.fs.FileSystem.from_uri``,
    which takes credentials and endpoints from the environment (AWS_* variables,
    AWS_ENDPOINT_URL for an S3-compatible server, GOOGLE_APPLICATION_CREDENTIALS, HADOOP_HOME),
    with connect and request timeouts added (remote.py).
    """
    text = str(path)
    scheme = text.partition("://")[0]
    if "://" in text and not is_remote(text) and scheme != "file":
        schemes = ", ".join(s + "://" for s in REMOTE_SCHEMES)
        raise DataError(f"data.path {text!r} has an unsupported scheme {scheme!r}.",
                        f"Use a local path or one of {schemes}.")
    if not is_remote(text):
        local = text.removeprefix("file://")
        return pafs.LocalFileSystem(), str(pafs.LocalFileSystem().normalize_path(local))
    try:
        fs, inner = open_remote(text)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"Can't open the filesystem of {text!r} ({e}).",
                        "Check the URI and the credentials in the environment.") from e
    return fs, inner.rstrip("/")


def _fix_for(err: BaseException) -> str:
    """How to fix a failed remote read: the endpoint when the network failed."""
    return STORAGE_FIX if is_network_error(err) else "Check the path and the storage credentials."


def read_meta(path: str) -> DatasetMeta:
    """meta.json of the dataset at ``path`` (local or remote), or a DataError naming it."""
    fs, root = filesystem(path)
    where = f"{root}/{META_FILE}"

    def read() -> bytes:
        with fs.open_input_stream(where) as f:
            return f.read()

    try:
        blob = bounded_on(fs, read, f"reading {path}/{META_FILE}")
    except FileNotFoundError:
        raise DataError(f"{path}/{META_FILE} is missing: {path!r} is not a dataset directory.",
                        "Point data.path at a directory written by the synthetic generator or "
                        "the MovieLens converter (or a copy of one in object storage).") from None
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"Can't read {path}/{META_FILE} ({e}).", _fix_for(e)) from e
    try:
        text = blob.decode()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}/{META_FILE} is not valid JSON ({e}).",
                        "Regenerate the dataset; meta.json is written by the generator.") from e
    return parse_meta_text(text, f"{path}/{META_FILE}")


@dataclass(frozen=True)
class RowGroup:
    """One Parquet row group: ``rows`` rows starting at ``first_row`` of ``file``."""

    file: str
    index: int
    first_row: int
    rows: int


@dataclass(frozen=True)
class Piece:
    """Rows ``start:stop`` (of the row group) of one row group, owned by one rank."""

    group: RowGroup
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def file_row(self) -> int:
        """Row of the file the piece starts at (for error messages)."""
        return self.group.first_row + self.start


class SplitIndex:
    """The row groups of one split of a dataset, from the shards' Parquet footers."""

    def __init__(self, fs: pafs.FileSystem, files: list[str], groups: list[RowGroup],
                 label: str) -> None:
        self.fs = fs
        self.files = files
        self.groups = groups
        self.label = label  # how messages name the dataset

    @classmethod
    def open(cls, path: str, split: str, expected_rows: int | None = None) -> SplitIndex:
        if split not in SPLITS:
            raise DataError(f"Unknown split {split!r}.", f"Use one of {', '.join(SPLITS)}.")
        fs, root = filesystem(path)
        try:
            infos = bounded_on(fs, lambda: fs.get_file_info(
                pafs.FileSelector(root, allow_not_found=True)), f"listing {path}")
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"Can't list {path!r} ({e}).", _fix_for(e)) from e
        names = sorted(i.path for i in infos if i.type == pafs.FileType.File
                       and i.base_name.startswith(f"{split}-")
                       and i.base_name.endswith(".parquet"))
        if not names:
            raise DataError(f"No {split} shards ({split}-XXXXX.parquet) in {str(path)!r}.",
                            "Regenerate the dataset or fix data.path.")
        groups: list[RowGroup] = []
        for name in names:
            md = open_parquet(fs, name).metadata
            first = 0
            for g in range(md.num_row_groups):
                rows = md.row_group(g).num_rows
                groups.append(RowGroup(name, g, first, rows))
                first += rows
        index = cls(fs, names, groups, str(path))
        if expected_rows is not None and index.total != expected_rows:
            shards = ", ".join(n.rsplit("/", 1)[-1] for n in names)
            raise DataError(
                f"{path}: meta.json says {expected_rows} samples but {shards} hold "
                f"{index.total} rows (a shard is missing or extra).",
                "Regenerate the dataset or restore the missing shard.")
        return index

    @cached_property
    def total(self) -> int:
        return sum(g.rows for g in self.groups)

    def share(self, rank: int, world: int) -> list[Piece]:
        """Rank ``rank``'s pieces, in global row order."""
        if world < 1 or not 0 <= rank < world:
            raise DataError(f"rank {rank} is not in a world of size {world}.",
                            "Pass 0 <= rank < world_size.")
        lo, hi = self.total * rank // world, self.total * (rank + 1) // world
        pieces, base = [], 0
        for g in self.groups:
            a, b = max(lo, base) - base, min(hi, base + g.rows) - base
            base += g.rows
            if a < b:
                pieces.append(Piece(g, a, b))
        return pieces


def piece_starts(pieces: list[Piece]) -> np.ndarray:
    """Rank-local first row of each piece (what batchers take as ``pieces``)."""
    sizes = np.array([p.rows for p in pieces], dtype=np.int64)
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def open_parquet(fs: pafs.FileSystem, name: str) -> pq.ParquetFile:
    """The shard ``name`` with its footer read (a remote read is bounded, see remote.py)."""
    try:
        return bounded_on(fs, lambda: pq.ParquetFile(open_input(fs, name)),
                          f"reading the footer of {name}")
    except (pa.ArrowException, OSError) as e:
        if is_network_error(e):
            raise read_failed(f"{name}: reading the footer", e) from e
        raise DataError(f"{name}: not a readable Parquet file ({e}).",
                        "The shard is corrupt or truncated; regenerate the dataset.") from e


def read_piece(handle: pq.ParquetFile, piece: Piece, columns: list[str] | None = None
               ) -> pa.Table:
    """The piece's rows (all columns, or ``columns``)."""
    try:
        table = handle.read_row_group(piece.group.index, columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise read_failed(f"{piece.group.file}: reading row group {piece.group.index}", e
                          ) from e
    return table.slice(piece.start, piece.rows)
