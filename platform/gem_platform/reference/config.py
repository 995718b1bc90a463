"""Settings of the linear reference (features and training), and its version.

``VERSION`` is part of the cache key: bump it whenever the features, the training or the
defaults below change what the reference scores.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

VERSION = 2


@dataclass(frozen=True)
class LinearReferenceConfig:
    """How the reference is built.

    ``recent_window``: history events, counted from the newest, that form the recent window
    (the older ones form the other window). ``chunk_rows``: samples read, featurized and
    held at once while training streams the train split (bounds memory); ``keep_mb``: the
    featurized train split is kept for the later epochs when it fits in this many MiB, else
    every epoch streams it again. ``epochs`` passes over the train split in minibatches of
    ``batch_size`` with Adagrad at ``lr`` and an L2 penalty on every weight of each task
    (``l2_ctr``, ``l2_cvr``: CVR learns from the clicked samples only, so it needs more).
    """

    recent_window: int = 8
    length_buckets: int = 12
    epochs: int = 3
    batch_size: int = 1024
    lr: float = 0.08
    l2_ctr: float = 1e-6
    l2_cvr: float = 1e-4
    chunk_rows: int = 8192
    keep_mb: int = 256
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
