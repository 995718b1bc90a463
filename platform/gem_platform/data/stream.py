"""One rank's share of a split, streamed: rows are read in the rolling batcher's stream order
(pieces of the rank's row groups, a seeded order per pass; see balance/rolling.py) by a
background thread, validated there, and held only while the batcher's window still needs them.

Contract with the batcher (``follow``): the table reads exactly the stream the batcher reads,
so every position the batcher hands to ``collate`` has been read or is about to be; rows leave
memory once batched. Memory: the batcher's window plus ``prefetch + 1`` chunks of
``chunk_rows`` rows. Same rows, same batches as the in-memory ``SampleTable`` of the same
share (parquet.py): both number a share's rows the same way (source.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem_platform.balance.rolling import RollingBatcher, pass_pieces
from gem_platform.data.arrays import SampleArrays
from gem_platform.data.batch import JaggedBatch
from gem_platform.data.meta import DatasetMeta
from gem_platform.data.parquet import collate, load_meta
from gem_platform.data.remote import read_failed
from gem_platform.data.source import Piece, SplitIndex, open_parquet, piece_starts, read_piece
from gem_platform.data.validate import from_arrow
from gem_platform.errors import DataError

DEFAULT_CHUNK_ROWS = 1024
DEFAULT_PREFETCH = 4


@dataclass
class _Chunk:
    """Rows read together: ``positions[i]`` is the rank-local row of ``arrays`` row i."""

    positions: np.ndarray
    arrays: SampleArrays


class _Stop:
    """Sentinel the reader thread leaves when asked to stop."""


class StreamingTable:
    """The rows of a rank's share that the batcher's window needs, read in stream order."""

    def __init__(self, path: str, split: str, rank: int = 0, world_size: int = 1, *,
                 truncate: bool = False, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                 prefetch: int = DEFAULT_PREFETCH) -> None:
        self._thread: threading.Thread | None = None
        self.meta: DatasetMeta = load_meta(path)
        expected = self.meta.num_train if split == "train" else self.meta.num_eval
        self.index = SplitIndex.open(str(path), split, expected_rows=expected)
        self.share: list[Piece] = self.index.share(rank, world_size)
        self.pieces = piece_starts(self.share)
        self.truncate = truncate
        self.chunk_rows = max(1, int(chunk_rows))
        self.prefetch = max(1, int(prefetch))
        self._keys = [s.name for s in self.meta.sparse_features]
        self.seq_lengths = self._scan_lengths()
        n = self.seq_lengths.size
        self._chunk_of = np.full(n, -1, dtype=np.int64)  # position -> chunk id
        self._row_of = np.full(n, -1, dtype=np.int64)  # position -> row in its chunk
        self._copies = np.zeros(n, dtype=np.int32)  # read and not yet batched
        self._chunks: dict[int, _Chunk] = {}
        self._live: dict[int, int] = {}  # chunk id -> rows still needed
        self._next_id = 0
        self._queue: queue.Queue = queue.Queue(maxsize=self.prefetch)
        self._stop = threading.Event()
        self._seed, self._rank, self._shuffle = 0, rank, True

    def __len__(self) -> int:
        return int(self.seq_lengths.size)

    @property
    def rows_held(self) -> int:
        """Rows in memory now (read, including those kept only by a chunk not yet freed)."""
        return sum(c.positions.size for c in self._chunks.values())

    # -- lengths, from the seq_len column alone ------------------------------------------

    def _scan_lengths(self) -> np.ndarray:
        """Every history length of the share, from the small seq_len column; rejects a history
        longer than the dataset's max_seq_len now (unless truncating), naming file and row."""
        parts, handles = [], {}
        limit = self.meta.max_seq_len
        self.truncated_rows = 0  # histories cut to max_seq_len, counted once per share row
        for piece in self.share:
            name = piece.group.file
            if name not in handles:
                handles = {name: open_parquet(self.index.fs, name)}
            column = read_piece(handles[name], piece, columns=["seq_len"])
            raw = checked_lengths(column, name, piece.file_row, limit, self.truncate)
            if limit > 0:
                self.truncated_rows += int((raw > limit).sum())
                raw = np.minimum(raw, limit)
            parts.append(raw)
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(parts)

    # -- following a batcher ------------------------------------------------------------

    def follow(self, batcher: RollingBatcher) -> None:
        """Read what ``batcher`` holds now (its window, at the start or after a resume), then
        stream on from where it stands."""
        if not isinstance(batcher, RollingBatcher):
            raise DataError("A streaming table needs a rolling-window batcher.",
                            "Set loader.batching to 'bbs_v2' or 'sequential' with "
                            "loader.window_samples.")
        if batcher.num_samples != len(self) or not np.array_equal(batcher.pieces, self.pieces):
            raise DataError("The batcher was built for other rows than this table holds.",
                            "Build it from this table's seq_lengths and pieces.")
        self.close()
        self._chunk_of[:] = -1
        self._copies[:] = 0
        self._chunks.clear()
        self._live.clear()
        self._seed, self._shuffle = batcher.cfg.seed, batcher.cfg.shuffle
        self._load_positions(batcher.pending)
        pass_, cursor = batcher.cursor
        self._start_reader(pass_, cursor)

    def _load_positions(self, positions: np.ndarray) -> None:
        """Random-access read of ``positions`` (each counted once per occurrence)."""
        if not positions.size:
            return
        np.add.at(self._copies, positions, 1)
        wanted = np.unique(positions)
        owner = np.searchsorted(self.pieces, wanted, side="right") - 1
        handles: dict[str, pq.ParquetFile] = {}
        for piece_id in np.unique(owner):
            piece = self.share[int(piece_id)]
            rows = wanted[owner == piece_id]
            name = piece.group.file
            if name not in handles:
                handles = {name: open_parquet(self.index.fs, name)}
            arrays = self._validate(read_piece(handles[name], piece), piece, 0)
            local = rows - self.pieces[piece_id]
            self._add(_Chunk(rows, arrays.take(local)), fresh=False)

    # -- the reader thread --------------------------------------------------------------

    def _start_reader(self, pass_: int, cursor: int) -> None:
        reader = _Reader(self.index, self.share, self.pieces, self.meta, self.chunk_rows,
                         self.truncate, self._seed, self._rank, self._shuffle)
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        # the thread holds the reader, not the table: a table dropped without close() is
        # collected, and its finalizer stops the thread
        self._thread = threading.Thread(target=reader.run,
                                        args=(pass_, cursor, self._queue, self._stop),
                                        name="gem-stream-reader", daemon=True)
        self._thread.start()

    def _validate(self, table: pa.Table, piece: Piece, offset: int) -> SampleArrays:
        return from_arrow(table, self.meta, piece.group.file,
                          first_row=piece.file_row + offset, truncate=self.truncate)

    def close(self) -> None:
        """Stop the reader thread (a later ``follow`` starts a new one)."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread = None

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self._stop.set()

    # -- the pool of rows ----------------------------------------------------------------

    def _add(self, chunk: _Chunk, fresh: bool = True) -> None:
        """Hold a chunk. ``fresh``: rows just read from the stream (one more copy each);
        rows already held keep their first copy's data."""
        if fresh:
            np.add.at(self._copies, chunk.positions, 1)
        new = self._chunk_of[chunk.positions] < 0
        if not new.any():
            return
        if not new.all():
            chunk = _Chunk(chunk.positions[new], chunk.arrays.take(np.flatnonzero(new)))
        cid = self._next_id
        self._next_id += 1
        self._chunks[cid] = chunk
        self._live[cid] = chunk.positions.size
        self._chunk_of[chunk.positions] = cid
        self._row_of[chunk.positions] = np.arange(chunk.positions.size)

    def _next_chunk(self) -> None:
        if self._thread is None:
            raise DataError("The streaming table is not following a batcher.",
                            "Call follow(batcher) before collating.")
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        self._add(item)

    def collate(self, indices: np.ndarray) -> JaggedBatch:
        """The samples ``indices`` (from the batcher, in its order) as one jagged batch; they
        leave memory unless the batcher still waits on another copy of them."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not idx.size:
            raise DataError("An empty batch was requested.", "Pass at least one index.")
        if idx.min() < 0 or idx.max() >= len(self):
            raise IndexError(f"indices must be in [0, {len(self)}), got {idx.min()}..{idx.max()}")
        while (self._copies[idx] <= 0).any():
            self._next_chunk()
        chunk_ids = self._chunk_of[idx]
        parts, order = [], np.empty(idx.size, dtype=np.int64)
        base = 0
        for cid in np.unique(chunk_ids):
            sel = np.flatnonzero(chunk_ids == cid)
            parts.append(self._chunks[int(cid)].arrays.take(self._row_of[idx[sel]]))
            order[sel] = base + np.arange(sel.size)
            base += sel.size
        batch = collate(SampleArrays.concat(parts), order, self._keys)
        self._consume(idx)
        return batch

    def _consume(self, idx: np.ndarray) -> None:
        np.add.at(self._copies, idx, -1)
        gone = idx[self._copies[idx] == 0]
        if not gone.size:
            return
        for cid, count in zip(*np.unique(self._chunk_of[gone], return_counts=True),
                              strict=True):
            cid = int(cid)
            self._live[cid] -= int(count)
            if self._live[cid] == 0:
                del self._chunks[cid], self._live[cid]
        self._chunk_of[gone] = -1
        self._compact()

    def _compact(self) -> None:
        """Copy out the few live rows of mostly-batched chunks, so one waiting sample doesn't
        keep a whole chunk in memory."""
        for cid in [c for c, live in self._live.items()
                    if live * 4 < self._chunks[c].positions.size]:
            chunk = self._chunks.pop(cid)
            del self._live[cid]
            keep = np.flatnonzero(self._chunk_of[chunk.positions] == cid)
            self._chunk_of[chunk.positions[keep]] = -1
            if keep.size:
                self._add(_Chunk(chunk.positions[keep], chunk.arrays.take(keep)), fresh=False)


@dataclass
class _Reader:
    """Reads the stream of one rank's share from a cursor on, into a bounded queue."""

    index: SplitIndex
    share: list[Piece]
    pieces: np.ndarray
    meta: DatasetMeta
    chunk_rows: int
    truncate: bool
    seed: int
    rank: int
    shuffle: bool

    def run(self, pass_: int, cursor: int, out: queue.Queue, stop: threading.Event) -> None:
        try:
            for chunk in self.stream(pass_, cursor, stop):
                while not stop.is_set():
                    try:
                        out.put(chunk, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as err:  # handed to the consumer, raised there
            out.put(err)

    def stream(self, pass_: int, cursor: int, stop: threading.Event) -> Iterator[_Chunk]:
        """Chunks of the stream from sample ``cursor`` of pass ``pass_`` on, forever."""
        sizes = np.array([p.rows for p in self.share], dtype=np.int64)
        if not sizes.size:
            return
        while not stop.is_set():
            order = pass_pieces(len(self.share), self.seed, pass_, self.rank, self.shuffle)
            ends = np.cumsum(sizes[order])
            first = int(np.searchsorted(ends, cursor, side="right"))
            skip = cursor - (int(ends[first - 1]) if first else 0)
            for k in range(first, order.size):
                if stop.is_set():
                    return
                yield from self.piece_chunks(int(order[k]), skip if k == first else 0)
            pass_, cursor = pass_ + 1, 0

    def piece_chunks(self, piece_id: int, skip: int) -> Iterator[_Chunk]:
        """The piece's rows from its row ``skip`` on, ``chunk_rows`` at a time, validated."""
        piece = self.share[piece_id]
        handle = open_parquet(self.index.fs, piece.group.file)
        begin = piece.start + skip  # row of the row group to start at
        seen = 0  # rows of the row group passed so far
        try:
            batches = handle.iter_batches(batch_size=self.chunk_rows,
                                          row_groups=[piece.group.index])
            for batch in batches:
                lo, hi = seen, seen + batch.num_rows
                seen = hi
                a, b = max(lo, begin), min(hi, piece.stop)
                if a >= b:
                    if lo >= piece.stop:
                        break
                    continue
                table = pa.Table.from_batches([batch.slice(a - lo, b - a)])
                arrays = from_arrow(table, self.meta, piece.group.file,
                                    first_row=piece.group.first_row + a, truncate=self.truncate)
                start = int(self.pieces[piece_id]) + (a - piece.start)
                yield _Chunk(np.arange(start, start + (b - a), dtype=np.int64), arrays)
        except (pa.ArrowException, OSError) as e:
            raise read_failed(f"{piece.group.file}: reading row group {piece.group.index}", e
                              ) from e


def checked_lengths(column: pa.Table, file: str, first_row: int, limit: int,
                    truncate: bool) -> np.ndarray:
    """History lengths (as stored) from a table holding only ``seq_len``, checked like the
    full validator checks them (null, negative, over ``limit`` unless truncating)."""
    col = column.column("seq_len").combine_chunks() if "seq_len" in column.column_names else None
    if col is None:
        raise DataError(f"{file}, column 'seq_len': missing column.",
                        "Fix the file that produced this shard or regenerate the dataset.")
    if col.null_count:
        row = int(np.flatnonzero(np.asarray(col.is_null()))[0])
        raise DataError(f"{file}, row {first_row + row}, column 'seq_len': null value.",
                        "Fix the file that produced this shard or regenerate the dataset.")
    lengths = col.to_numpy(zero_copy_only=False).astype(np.int64)
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        r = int(bad[0])
        raise DataError(f"{file}, row {first_row + r}, column 'seq_len': negative history "
                        f"length {lengths[r]}.",
                        "Fix the file that produced this shard or regenerate the dataset.")
    if limit > 0:
        over = np.flatnonzero(lengths > limit)
        if over.size and not truncate:
            r = int(over[0])
            raise DataError(
                f"{file}, row {first_row + r}, column 'seq_len': history of {lengths[r]} events, "
                f"longer than the dataset's max_seq_len {limit} (meta.json).",
                "Fix or drop the row, or set data.history_overflow: truncate in the recipe to "
                "keep each over-long history's newest max_seq_len events.")
    return lengths
