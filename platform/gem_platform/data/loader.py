"""A rank's training batches: the table (in memory, or streamed when the loader section sets
``window_samples``) and the batcher, opened together so they agree on the rows' order.

    table = open_table(path, "train", rank, world, loader_cfg, truncate=...)
    batcher = make_batcher(loader_cfg, table.seq_lengths, steps, rank, pieces=table.pieces,
                           expected_work=expected_work(table.meta, loader_cfg))
    batcher.load_state_dict(saved)            # on resume, before iterating
    for batch, indices in iterate(table, batcher, start_epoch): ...

The in-memory and streaming tables give the same batches for the same batcher.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from gem_platform.balance import Batcher, LoaderConfig
from gem_platform.balance.cost import sample_work
from gem_platform.data.batch import JaggedBatch
from gem_platform.data.meta import DatasetMeta
from gem_platform.data.parquet import SampleTable
from gem_platform.data.stream import StreamingTable

Table = SampleTable | StreamingTable


def open_table(path: str, split: str, rank: int, world_size: int, loader: LoaderConfig, *,
               truncate: bool = False) -> Table:
    """The rank's share of ``split``: streamed when ``loader.window_samples`` is set (train
    split only), else read into memory."""
    if split == "train" and loader.window_samples is not None:
        return StreamingTable(path, split, rank, world_size, truncate=truncate)
    return SampleTable.load(path, split, rank, world_size, truncate=truncate)


def expected_work(meta: DatasetMeta, cfg: LoaderConfig) -> float | None:
    """The dataset's mean work per sample under ``cfg.cost``, from meta.json's length
    histogram (``extra.seq_len_histogram``: count of train samples per length); None when the
    dataset does not record one (batchers then use their own share's mean)."""
    hist = meta.extra.get("seq_len_histogram") if meta.extra else None
    if not hist:
        return None
    counts = np.asarray(hist, dtype=np.float64)
    lengths = np.arange(counts.size)
    total = counts.sum()
    if total <= 0:
        return None
    return float((sample_work(lengths, cfg.cost, cfg.model_dim) * counts).sum() / total)


def iterate(table: Table, batcher: Batcher, start_epoch: int
            ) -> Iterator[tuple[JaggedBatch, np.ndarray]]:
    """(batch, indices) for every step from ``start_epoch`` on (and the batcher's saved
    position within it, when it was loaded from a checkpoint)."""
    if isinstance(table, StreamingTable):
        table.follow(batcher)  # type: ignore[arg-type]
    epoch = start_epoch
    try:
        while True:
            for indices in batcher.epoch(epoch):
                yield table.collate(indices), indices
            epoch += 1
    finally:
        if isinstance(table, StreamingTable):
            table.close()


def split_lengths(path: str, split: str = "train", *, truncate: bool = False) -> np.ndarray:
    """Every history length of ``split``, from the seq_len column alone (no other column is
    read, so this is cheap on a large or remote dataset)."""
    return StreamingTable(path, split, truncate=truncate).seq_lengths


def seq_len_histogram(lengths: np.ndarray) -> list[int]:
    """Count of samples per history length (index = length): what meta.json records so
    every rank knows the dataset's work distribution without reading it."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.bincount(lengths, minlength=1).tolist() if lengths.size else [0]
