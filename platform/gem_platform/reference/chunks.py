"""A dataset split read in bounded chunks of validated samples, in row order."""

from __future__ import annotations

from collections.abc import Iterator

from gem_platform.data.arrays import SampleArrays
from gem_platform.data.meta import DatasetMeta
from gem_platform.data.source import SplitIndex, open_parquet, read_piece
from gem_platform.data.validate import from_arrow


def iter_chunks(path: str, meta: DatasetMeta, split: str, chunk_rows: int,
                *, truncate: bool = False) -> Iterator[SampleArrays]:
    """Every row of ``split`` once, as consecutive chunks of at most ``chunk_rows`` rows.

    At most one row group and one chunk are held at a time. ``truncate``: histories longer
    than the dataset's max_seq_len keep their newest events instead of raising.
    """
    expected = meta.num_train if split == "train" else meta.num_eval
    index = SplitIndex.open(path, split, expected_rows=expected)
    handle, name = None, None
    for piece in index.share(0, 1):
        if piece.group.file != name:
            name = piece.group.file
            handle = open_parquet(index.fs, name)
        table = read_piece(handle, piece)
        for start in range(0, table.num_rows, chunk_rows):
            part = table.slice(start, chunk_rows)
            yield from_arrow(part, meta, name, first_row=piece.file_row + start,
                             truncate=truncate)
