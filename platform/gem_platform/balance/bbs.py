"""Base Batch Shuffling: balance a rank's full batches locally, with no communication.

The epoch's shuffled samples are cut into base batches (``base_batch_size`` samples). A
buffer of ``buffer_full_batches * k`` consecutive base batches (k = base batches per full
batch) is sorted by work and paired heaviest with lightest; the pairs are then dealt to the
buffer's full batches, k/2 pairs each, heaviest pair to the currently lightest full batch
(round-wise LPT, see partition.py). With odd k, the buffer's f median base batches stay
unpaired and are dealt last, one per full batch. Every full batch of a buffer then carries
nearly the buffer's mean work, so a rank's step work varies only as much as its buffer means
do: the spread across ranks shrinks like 1/sqrt(buffer_full_batches).

GEM's example: 16 base batches of total lengths 16..1 make 8 pairs of 17; two full batches of
4 pairs each carry 68.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from gem_platform.balance.base import Batcher
from gem_platform.balance.partition import lpt_rounds


def plan_buffer(base_work: np.ndarray, per_full: int) -> np.ndarray:
    """Which base batches form each full batch: (f, per_full) positions into ``base_work``.

    ``base_work`` holds the work of f * per_full base batches (one buffer).
    """
    base_work = np.asarray(base_work, dtype=np.float64)
    m = base_work.size
    f = m // per_full
    pairs_per_full = per_full // 2
    p = f * pairs_per_full
    order = np.argsort(-base_work, kind="stable")
    heavy = order[:p]
    light = order[m - p :][::-1]  # lightest first, so heavy[i] meets the i-th lightest
    assign, loads = lpt_rounds(base_work[heavy] + base_work[light], f)
    by_full = np.argsort(assign, kind="stable")
    columns = [heavy[by_full].reshape(f, pairs_per_full),
               light[by_full].reshape(f, pairs_per_full)]
    if per_full % 2:
        singles = order[p : m - p]
        single_assign, _ = lpt_rounds(base_work[singles], f, loads)
        columns.append(singles[np.argsort(single_assign, kind="stable")].reshape(f, 1))
    return np.concatenate(columns, axis=1)


class BBSBatcher(Batcher):
    """Full batches of k base batches, balanced within each buffer of full batches."""

    def _batches(self, order: np.ndarray, start: int) -> Iterator[tuple[int, np.ndarray]]:
        cfg = self.cfg
        k = cfg.base_batches_per_full_batch
        buffer = cfg.buffer_full_batches
        base = order.reshape(-1, cfg.base_batch_size)  # (steps * k, base_batch_size)
        base_work = self.work[base].sum(axis=1)
        for first in range(start - start % buffer, self.steps_per_epoch, buffer):
            f = min(buffer, self.steps_per_epoch - first)
            lo = first * k
            members = plan_buffer(base_work[lo : lo + f * k], k) + lo  # (f, k)
            fulls = base[members].reshape(f, k * cfg.base_batch_size)
            for j in range(max(0, start - first), f):
                yield first + j, fulls[j]
