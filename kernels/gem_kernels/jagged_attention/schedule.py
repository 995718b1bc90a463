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
import triton
import triton.language as tl

from gem_kernels.dispatch import interpreting

# One program sorts up to this many sequences in registers; larger batches use torch ops.
MAX_KERNEL_BATCH = 8192


def schedule_bound(total_tokens: int, batch: int, block: int) -> int:
    return total_tokens // block + batch


@triton.jit(do_not_specialize=["batch", "bound"])
def _schedule_kernel(offsets, out, batch, bound, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
                     CHUNK: tl.constexpr):
    """One program: sort sequences by length (descending, stable), then write each one's
    blocks, last first, at its place in the running total; -1 past the real work."""
    idx = tl.arange(0, BLOCK_B)
    ok = idx < batch
    start = tl.load(offsets + idx, mask=ok, other=0)
    end = tl.load(offsets + idx + 1, mask=ok, other=0)
    length = (end - start).to(tl.int64)
    # key: length in the high bits, then (BLOCK_B - 1 - idx) so equal lengths keep index order
    key = tl.where(ok, length * BLOCK_B + (BLOCK_B - 1 - idx), -1)
    key = tl.sort(key, descending=True)
    valid = key >= 0
    seq = tl.where(valid, BLOCK_B - 1 - (key % BLOCK_B), -1).to(tl.int32)
    nblk = tl.where(valid, (key // BLOCK_B + BLOCK - 1) // BLOCK, 0)
    ends = tl.cumsum(nblk, 0)
    total = tl.sum(nblk, 0)
    for j in range(0, tl.max(nblk, 0)):
        has = j < nblk
        pos = ends - nblk + j  # the sequence's j-th program takes its (nblk-1-j)-th block
        tl.store(out + pos, seq, mask=has)
        tl.store(out + bound + pos, (nblk - 1 - j).to(tl.int32), mask=has)
    for c in range(0, bound, CHUNK):
        p = c + tl.arange(0, CHUNK)
        m = (p >= total) & (p < bound)
        tl.store(out + p, tl.full([CHUNK], -1, tl.int32), mask=m)
        tl.store(out + bound + p, tl.zeros([CHUNK], tl.int32), mask=m)


def build_schedule(offsets: torch.Tensor, total_tokens: int, block: int) -> torch.Tensor:
    """(2, bound) int32: row 0 = sequence index (-1 = no work), row 1 = block index."""
    batch = offsets.numel() - 1
    bound = schedule_bound(total_tokens, batch, block)
    dev = offsets.device
    if 0 < batch <= MAX_KERNEL_BATCH and bound > 0 and (
            dev.type == "cuda" or interpreting()) and not _KERNEL_FAILED:
        out = torch.empty((2, bound), dtype=torch.int32, device=dev)
        block_b = max(16, triton.next_power_of_2(batch))
        try:
            _schedule_kernel[(1,)](offsets, out, batch, bound, BLOCK=block, BLOCK_B=block_b,
                                   CHUNK=1024, num_warps=4 if block_b <= 1024 else 8)
            return out
        except Exception:  # noqa: BLE001 - a compile failure must not take the op down
            _mark_kernel_failed()
    return build_schedule_torch(offsets, total_tokens, block)


_KERNEL_FAILED = False


def _mark_kernel_failed() -> None:
    global _KERNEL_FAILED
    _KERNEL_FAILED = True



def build_schedule_torch(offsets: torch.Tensor, total_tokens: int, block: int) -> torch.Tensor:
    """build_schedule in torch ops (any batch size; ~20 small launches)."""
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
