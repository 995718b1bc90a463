"""No balancing: consecutive runs of the shuffled samples, what a plain loader does."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from gem_platform.balance.base import Batcher


class SequentialBatcher(Batcher):
    """Batch ``s`` is samples ``s*B .. (s+1)*B - 1`` of the epoch's permutation."""

    def _batches(self, order: np.ndarray, start: int) -> Iterator[tuple[int, np.ndarray]]:
        rows = order.reshape(self.steps_per_epoch, self.cfg.local_batch_size)
        for step in range(start, self.steps_per_epoch):
            yield step, rows[step]
