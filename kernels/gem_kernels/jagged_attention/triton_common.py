"""What the jagged flash attention forward and backward kernels share: the sequence block a
program owns, the key range a query block sees, row tiles of one sequence (masked pointer
loads, per-sequence device-side descriptors or one host-side ragged descriptor) and the
causal / window band mask.

A schedule (gem_kernels.jagged_attention.schedule) is a (2, n) int32 array: program pid of
axis 1 owns block ``sched[1, pid]`` of sequence ``sched[0, pid]`` (-1: nothing to do); axis 0
of the grid is the head.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
RAGGED_ROWS: tl.constexpr = tl.constexpr(0x40000000)  # triton.tools.ragged_tma's 2**30

# Load paths (the kernels' USE_TMA): masked pointer loads, per-sequence device-side tensor
# descriptors, or one host-side ragged descriptor per tensor (triton.tools.ragged_tma).
LOAD_PTR, LOAD_TMA_DEVICE, LOAD_TMA_RAGGED = 0, 1, 2


@triton.jit
def sequence_block(sched, n_sched, offsets):
    """(sequence, block, first token as int64, length as int32) of this program's item
    (program_id(1)); sequence < 0 means the program has nothing to do (the kernel returns;
    the other values are then meaningless)."""
    pid = tl.program_id(1)
    seq = tl.load(sched + pid)
    blk = tl.load(sched + n_sched + pid)
    safe = tl.maximum(seq, 0)
    start = tl.load(offsets + safe).to(tl.int64)
    length = (tl.load(offsets + safe + 1) - start).to(tl.int32)
    return seq, blk, start, length


@triton.jit
def query_block_key_range(m0, L, WL, WR, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """For the query rows m0 .. m0+BLOCK_M-1 of a sequence of L rows: (lo, hi), the key range
    any of its real rows may see (lo rounded down to a key tile), and [full_lo, full_hi), the
    key tiles every row of the block sees whole (no mask needed; empty: both = lo)."""
    m_last = tl.minimum(m0 + BLOCK_M, L) - 1  # last real query row of the block
    hi = L
    lo = 0
    if CAUSAL:
        hi = tl.minimum(hi, m_last + 1)
    if HAS_WINDOW:
        hi = tl.minimum(hi, m_last + WR + 1)
        lo = tl.maximum(m0 - WL, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_hi = (L // BLOCK_N) * BLOCK_N
    full_lo = lo
    if CAUSAL:
        full_hi = tl.minimum(full_hi, ((m0 + 1) // BLOCK_N) * BLOCK_N)
    if HAS_WINDOW:
        full_hi = tl.minimum(full_hi, ((m0 + WR + 1) // BLOCK_N) * BLOCK_N)
        full_lo = tl.maximum(full_lo, tl.cdiv(tl.maximum(m_last - WL, 0), BLOCK_N) * BLOCK_N)
    if full_hi <= full_lo:
        full_lo = lo
        full_hi = lo
    return lo, hi, full_lo, full_hi


@triton.jit
def load_rows(src, base_ptr, seq_start, row0, n_rows, col0, stride_t,
              BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr,
              MASKED: tl.constexpr):
    """Rows [row0, row0 + BLOCK) of one head of one sequence; rows >= n_rows read as 0.
    USE_TMA: 0 = masked pointer loads, 1 = a per-sequence device-side descriptor, 2 = one
    host-side ragged descriptor for the whole jagged tensor (triton.tools.ragged_tma)."""
    if USE_TMA == 1:
        return src.load([row0, col0])
    elif USE_TMA == 2:
        # ragged_tma's indexing: rows past n_rows fall outside the descriptor's bounds
        x = tl.load_tensor_descriptor(src, [RAGGED_ROWS, seq_start + n_rows,
                                            RAGGED_ROWS - n_rows + row0, col0])
        return tl.reshape(x, [BLOCK, HEAD_DIM])
    else:
        rows = row0 + tl.arange(0, BLOCK)
        cols = col0 + tl.arange(0, HEAD_DIM)
        ptrs = base_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :]
        if MASKED:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def store_rows(dst, base_ptr, seq_start, row0, n_rows, col0, stride_t, value,
               BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """Stores a (BLOCK, HEAD_DIM) tile at rows [row0, row0 + BLOCK); rows >= n_rows are
    skipped (USE_TMA as load_rows)."""
    if USE_TMA == 1:
        dst.store([row0, col0], value)
    elif USE_TMA == 2:
        tl.store_tensor_descriptor(dst, [RAGGED_ROWS, seq_start + n_rows,
                                         RAGGED_ROWS - n_rows + row0, col0],
                                   tl.reshape(value, [1, 1, BLOCK, HEAD_DIM]))
    else:
        rows = row0 + tl.arange(0, BLOCK)
        cols = col0 + tl.arange(0, HEAD_DIM)
        ptrs = base_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :]
        tl.store(ptrs, value, mask=rows[:, None] < n_rows)


@triton.jit
def make_src(desc, base_ptr, n_rows, stride_t, H_D, BLOCK: tl.constexpr,
             HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """What load_rows/store_rows take: a descriptor over one sequence's rows (all heads side
    by side), the host's ragged descriptor, or the sequence's base pointer."""
    if USE_TMA == 1:
        return tl.make_tensor_descriptor(base_ptr, shape=[n_rows, H_D], strides=[stride_t, 1],
                                         block_shape=[BLOCK, HEAD_DIM])
    elif USE_TMA == 2:
        return desc
    else:
        return base_ptr


@triton.jit
def band_mask(offs_m, offs_n, L, WL, WR, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              CHECK_END: tl.constexpr):
    """(M, N) mask of the keys offs_n each query offs_m may see: causal (j <= i), window
    (i - WL <= j <= i + WR) and, with CHECK_END, inside the sequence (j < L)."""
    mask = offs_n[None, :] >= 0
    if CHECK_END:
        mask = mask & (offs_n[None, :] < L)
    if CAUSAL:
        mask = mask & (offs_n[None, :] <= offs_m[:, None])
    if HAS_WINDOW:
        mask = mask & (offs_n[None, :] >= offs_m[:, None] - WL)
        mask = mask & (offs_n[None, :] <= offs_m[:, None] + WR)
    return mask
