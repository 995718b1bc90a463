"""Tile schedules for jagged kernels: one program per (sequence, block) with no padding, long
sequences first, built on the GPU with no host synchronisation.

A schedule for block size BLOCK is two int32 arrays of ``bound = total_tokens // BLOCK + B``
entries (an upper bound on sum_b ceil(L_b / BLOCK), known on the host without reading offsets):
``seq[p]`` (-1 for the unused tail) and ``blk[p]``. Sequences are taken longest first; within a
sequence the blocks run last-to-first (the last query blocks of a causal sequence hold the most
work). Kernels are launched on a (heads, bound) grid, heads fastest, so every head of the
longest sequence starts in the first wave and the short ones fill the tail.
"""

from __future__ import annotations

import torch


def schedule_bound(total_tokens: int, batch: int, block: int) -> int:
    return total_tokens // block + batch


def build_schedule(offsets: torch.Tensor, total_tokens: int, block: int) -> torch.Tensor:
    """(2, bound) int32: row 0 = sequence index (-1 = no work), row 1 = block index."""
    batch = offsets.numel() - 1
    bound = schedule_bound(total_tokens, batch, block)
    dev = offsets.device
    out = torch.full((2, max(bound, 1)), -1, dtype=torch.int32, device=dev)
    if batch == 0 or bound == 0:
        return out
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
    order = torch.argsort(lengths, descending=True, stable=True)
    nblk = (lengths[order] + block - 1) // block
    ends = torch.cumsum(nblk, 0)  # exclusive end program of each ranked sequence
    pids = torch.arange(bound, device=dev, dtype=torch.int64)
    rank = torch.searchsorted(ends, pids, right=True)  # == batch past the real work
    valid = rank < batch
    rank_c = rank.clamp_max(batch - 1)
    end = ends[rank_c]
    blk = end - 1 - pids  # last block first
    out[0] = torch.where(valid, order[rank_c], -1).to(torch.int32)
    out[1] = torch.where(valid, blk, 0).to(torch.int32)
    return out


class ScheduleCache:
    """Schedules of one offsets tensor, by block size (forward and backward share them)."""

    def __init__(self, offsets: torch.Tensor, total_tokens: int):
        self.offsets = offsets
        self.total_tokens = total_tokens
        self._by_block: dict[int, torch.Tensor] = {}

    def get(self, block: int) -> torch.Tensor:
        s = self._by_block.get(block)
        if s is None:
            s = build_schedule(self.offsets, self.total_tokens, block)
            self._by_block[block] = s
        return s
