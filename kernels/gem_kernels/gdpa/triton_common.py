"""What the GDPA forward and backward kernels share: the tile config, the persistent work list's
read-out, row tiles of a jagged sample (pointer and ragged-TMA), the norm factor and the launch
helpers (dot precision, TMA eligibility, ragged descriptors).

A schedule (gem_kernels.gdpa.schedule) is an int32 ``items`` array of 6 ints per item (block,
head, row_start, row_len, col_start, col_len) and a ``prog_ptr`` array: program p runs items
prog_ptr[p] .. prog_ptr[p+1]-1. "Rows" are the side an item owns (a block of it), "cols" the
side it loops over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.ragged_tma import create_ragged_descriptor


@dataclass(frozen=True)
class TileConfig:
    """Block sizes and launch shape of one kernel."""

    block_rows: int
    block_cols: int
    num_warps: int = 4
    num_stages: int = 2
    ctas_per_sm: int = 2
    prefetch: bool = True
    # Forward only: items are a sample's whole KV (block_rows >= its length) per head and
    # stream the sample's query tiles of block_cols rows (for short KV: K, V loaded once).
    kv_major: bool = False
    # Forward over query blocks and the one-pass backward: load (and store) tiles through
    # ragged TMA descriptors (rows past a sample read as 0 and are never written, in
    # hardware; no address or mask arithmetic per element). Needs 16-byte aligned rows.
    tma: bool = False
    # Forward TMA kernel only: flatten the item and KV loops into one software pipeline, so
    # the next item's first tiles load while the current item finishes.
    flatten: bool = False
    # Forward TMA kernel only: Triton's warp specialization of the KV loop (producer warps
    # issue the loads, consumer warpgroups the matmuls and the activation).
    warp_specialize: bool = False
    # Where gelu_tanh / identity apply the attention scale: see activations.scale_args.
    scale_mode: str = "const"
    # dK/dV kernel with dQ (one-pass backwards) only: compute dQ^T = K^T dS^T, a product
    # with head_dim rows, instead of dS K with the query tile's rows (see triton_bwd).
    dq_transposed: bool = False


def pow2_at_least(n: int, lo: int, hi: int) -> int:
    """The power of two >= n, clamped to [lo, hi]."""
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def dot_precision(x: torch.Tensor) -> str:
    """tl.dot's input_precision: fp32 inputs get exact fp32 dots (tests, fp32 training);
    16-bit ones ignore it."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def tma_ok(*tensors: torch.Tensor) -> bool:
    """The TMA kernels take 16-bit tensors (their fp32 tiles would not fit in shared memory)
    with 16-byte aligned bases and row strides (contiguous (rows, H, d) tensors); the
    launchers fall back to the pointer kernels otherwise."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.element_size() == 2
               and (t.shape[1] * t.shape[2] * t.element_size()) % 16 == 0 for t in tensors)


def ragged_desc(x: torch.Tensor, rows: int) -> object:
    """Ragged TMA descriptor over a contiguous (rows, H, d) tensor viewed as (rows, H * d),
    loading (rows, d) tiles (triton.tools.ragged_tma)."""
    return create_ragged_descriptor(x.view(x.shape[0], -1), [rows, x.shape[2]])


@triton.jit
def program_items(prog_ptr):
    """(first, end) of this program's items in the work list."""
    pid = tl.program_id(0)
    return tl.load(prog_ptr + pid), tl.load(prog_ptr + pid + 1)


@triton.jit
def load_meta(items, it):
    """(block, head, row_start, row_len, col_start, col_len) of item ``it``: independent
    scalar loads, so prefetching them never waits on another load."""
    base = items + it * 6
    return (tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3),
            tl.load(base + 4), tl.load(base + 5))


@triton.jit
def tile_rows(start, row0, length, BLOCK: tl.constexpr):
    """Rows row0 .. row0+BLOCK-1 of a sample that starts at row ``start`` and has ``length``
    rows: their global indices as int64 (BLOCK, 1) and the (BLOCK, 1) in-sample mask."""
    rows = row0 + tl.arange(0, BLOCK)
    mask = (rows < length)[:, None]
    return (start + rows).to(tl.int64)[:, None], mask


@triton.jit
def load_rows(ptr, start, length, blk, h, stride_t, stride_h, BLOCK: tl.constexpr,
              D: tl.constexpr):
    """(BLOCK, D) tile of rows blk*BLOCK.. of one sample and head; rows past the end are 0."""
    grow, mask = tile_rows(start, blk * BLOCK, length, BLOCK)
    offs = grow * stride_t + h * stride_h + tl.arange(0, D)[None, :]
    return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def store_rows(ptr, x, start, length, blk, h, stride_t, stride_h, BLOCK: tl.constexpr,
               D: tl.constexpr):
    """Stores a (BLOCK, D) tile at rows blk*BLOCK.. of one sample and head (in ptr's dtype);
    rows past the end are skipped."""
    grow, mask = tile_rows(start, blk * BLOCK, length, BLOCK)
    offs = grow * stride_t + h * stride_h + tl.arange(0, D)[None, :]
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_factor(col_len, inv_max_kv, NORM: tl.constexpr):
    """1/n for norm 'kv_len' (0 rows -> 0, the sum is 0 anyway), 1/max_kv, or 1."""
    if NORM == 1:
        return 1.0 / tl.maximum(col_len, 1).to(tl.float32)
    elif NORM == 2:
        return inv_max_kv
    else:
        return 1.0


RAGGED_ROWS = tl.constexpr(0x40000000)  # the ragged descriptor's row extent (2**30)


@triton.jit
def load_ragged_rows(desc, start, length, row, col, BLOCK: tl.constexpr, D: tl.constexpr):
    """(BLOCK, D) tile of rows start+row.. of a sample of ``length`` rows through a ragged
    descriptor (triton.tools.ragged_tma's index scheme): rows past the sample read as 0."""
    x = desc.load([RAGGED_ROWS, start + length, RAGGED_ROWS - length + row, col])
    return tl.reshape(x, [BLOCK, D])


@triton.jit
def store_ragged_rows(desc, start, length, row, col, x, BLOCK: tl.constexpr,
                      D: tl.constexpr):
    """Stores a (BLOCK, D) tile at rows start+row..; rows past the sample are skipped."""
    desc.store([RAGGED_ROWS, start + length, RAGGED_ROWS - length + row, col],
               tl.reshape(x, [1, 1, BLOCK, D]))


@triton.jit
def add_ragged_rows(desc, start, length, row, col, x, BLOCK: tl.constexpr, D: tl.constexpr):
    """Adds a (BLOCK, D) fp32 tile at rows start+row.. by TMA reduce-add (order-dependent in
    its last bits); rows past the sample are skipped."""
    desc.atomic_add([RAGGED_ROWS, start + length, RAGGED_ROWS - length + row, col],
                    tl.reshape(x, [1, 1, BLOCK, D]))
