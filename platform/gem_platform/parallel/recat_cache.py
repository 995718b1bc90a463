"""One permutation index per layout for TorchRec's input all-to-all, instead of one per batch.

TorchRec's KJT all-to-all builds its feature permutation ("recat") from Python lists on every
batch, with ``torch.tensor(list, device=...)``: on a GPU that is a copy from pageable host
memory, so the host waits until the GPU has run everything queued before it. That happens once
per sharded module per step (twice for GemModel: items and sparse features), even on a single
rank, where the index is built and then not used. It stops the host from running ahead of the
GPU, which is what a launch-bound step needs most.

The index depends only on its arguments (local split, number of splits, stagger, device and the
batch size of each rank), and TorchRec only reads it (it feeds permute kernels), so
``install()`` makes ``torchrec.distributed.dist_data._get_recat`` return one cached tensor per
argument tuple. Inside a torch.compile trace it builds the tensor as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torchrec.distributed import dist_data

CACHED_LAYOUTS = 256  # distinct (splits, stagger, device, batch sizes) kept; each a few ints


def install() -> None:
    """Route TorchRec's recat builder through the cache (idempotent)."""
    if not getattr(dist_data._get_recat, "cached_by_gem", False):
        dist_data._get_recat = cached_recat(dist_data._get_recat)


def cached_recat(build: Callable[..., torch.Tensor | None]) -> Callable[..., torch.Tensor | None]:
    """``build`` (TorchRec's ``_get_recat`` signature) with its results cached per arguments."""

    @functools.lru_cache(maxsize=CACHED_LAYOUTS)
    def cached(local_split: int, num_splits: int, stagger: int, device: torch.device | None,
               batch_size_per_rank: tuple[int, ...] | None) -> torch.Tensor | None:
        sizes = None if batch_size_per_rank is None else list(batch_size_per_rank)
        return build(local_split, num_splits, stagger, device, sizes)

    @functools.wraps(build)
    def get_recat(local_split: int, num_splits: int, stagger: int = 1,
                  device: torch.device | None = None,
                  batch_size_per_rank: list[int] | None = None) -> torch.Tensor | None:
        if torch.compiler.is_compiling():
            return build(local_split, num_splits, stagger, device, batch_size_per_rank)
        sizes = None if batch_size_per_rank is None else tuple(batch_size_per_rank)
        return cached(local_split, num_splits, stagger, device, sizes)

    get_recat.cached_by_gem = True  # type: ignore[attr-defined]
    return get_recat
