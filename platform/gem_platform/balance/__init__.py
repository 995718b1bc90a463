"""Batch balancing: Base Batch Shuffling, its cost models, and the padding-waste and
straggler-overhead measures that tell whether balancing (or jagged kernels) pay."""

from __future__ import annotations

import numpy as np

from gem_platform.balance.base import Batcher, LoaderStateError, common_steps_per_epoch
from gem_platform.balance.bbs import BBSBatcher
from gem_platform.balance.config import LoaderConfig
from gem_platform.balance.cost import batch_work, sample_work
from gem_platform.balance.rolling import PackingBatcher, ShuffleBufferBatcher
from gem_platform.balance.sequential import SequentialBatcher
from gem_platform.balance.stats import (
    BalanceTracker,
    StepBalance,
    measure_step,
    padding_waste,
    straggler_overhead,
)


def make_batcher(
    cfg: LoaderConfig,
    seq_lengths: np.ndarray,
    steps_per_epoch: int | None = None,
    rank: int = 0,
    pieces: np.ndarray | None = None,
    expected_work: float | None = None,
) -> Batcher:
    """The batcher ``cfg.batching`` names, over one rank's samples (``seq_lengths``: one
    length per sample the rank holds). See base.py for the step count, tail and resume
    rules. ``pieces`` (first position of each row-group slice the rank reads) orders a
    rolling window's stream (rolling.py); the whole share is one piece without it.
    ``expected_work``: the dataset's mean work per sample under ``cfg.cost``, which BBS v2
    packs every batch to (default: the mean of ``seq_lengths``'s work)."""
    if cfg.batching == "bbs_v2":
        return PackingBatcher(cfg, seq_lengths, steps_per_epoch, rank=rank, pieces=pieces,
                              expected_work=expected_work)
    if cfg.batching == "sequential" and cfg.window_samples is not None:
        return ShuffleBufferBatcher(cfg, seq_lengths, steps_per_epoch, rank=rank, pieces=pieces)
    cls = BBSBatcher if cfg.batching == "bbs" else SequentialBatcher
    return cls(cfg, seq_lengths, steps_per_epoch, rank=rank)


__all__ = [
    "BBSBatcher",
    "BalanceTracker",
    "Batcher",
    "LoaderConfig",
    "LoaderStateError",
    "PackingBatcher",
    "SequentialBatcher",
    "ShuffleBufferBatcher",
    "StepBalance",
    "batch_work",
    "common_steps_per_epoch",
    "make_batcher",
    "measure_step",
    "padding_waste",
    "sample_work",
    "straggler_overhead",
]
