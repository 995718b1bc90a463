"""Jagged flash attention forward in Triton: no padding, one program per (sequence, query block,
head), long sequences first (see schedule.py).

Tiles are loaded through per-sequence tensor descriptors (TMA on Hopper): the descriptor's shape
ends at the sequence's last row, so rows past it load as zeros and stores past it are dropped.
Key tiles fall in three ranges per query block:

* full tiles, inside the sequence and inside the causal/window band for every query row: no
  masking at all;
* band tiles (causal diagonal, window edges): an explicit ``tl.where`` mask;
* with neither causal nor window, the one partial tile at the sequence end. BOUNDARY selects how
  it is handled (op.default_boundary picks, by head dim, from H200 timings: the one-loop modes
  win, since a second loop for one tile drains the software pipeline):
  - ``BOUNDARY_TRICK``: full tiles in one unmasked loop; the partial tile in a
    second loop, unmasked too: the zero-filled key rows score exactly 0, so each adds exactly
    ``exp2(0 - m)`` to the row sum and nothing to the numerator (their V rows are zero too);
    subtract ``n_pad * exp2(-m)`` instead of masking. It is exact up to the rounding of the
    row sum, and a guard keeps it so: if the spurious terms outweigh the row's total by more
    than 2^8 (which needs every real score of the row so far to sit far below zero) the tile
    is redone with the mask;
  - ``BOUNDARY_TRICK_FUSED``: the same subtraction, but since n_pad is 0 on every other tile
    all tiles share one unmasked loop (no loop split, so the software pipeline never drains
    between the full tiles and the partial one); the guard runs once after the loop and
    redoes the block with the mask if needed. Default for d <= 64 (H200, d=64 mix: 0.532 ms
    vs 0.567 for mask_all and 0.549 for the two-loop trick);
  - ``BOUNDARY_WHERE``: full tiles in one loop, the partial tile with a ``tl.where`` mask;
  - ``BOUNDARY_MASK_ALL``: one loop that masks every tile (a naive kernel). Default for d=128,
    where the mask's element-wise work hides under the larger matmuls (H200 mix: 0.959 ms vs
    0.969 fused trick, 1.026 two-loop trick).

The row log-sum-exp is written in base 2 and scaled units (``m + log2(l)`` with scores
``qk * scale * log2(e)``) for the backward pass; rows with no valid key get output 0 and
LSE = +inf (so the backward gives them no gradient).
"""

from __future__ import annotations

import triton
import triton.language as tl

BOUNDARY_WHERE = 0
BOUNDARY_TRICK = 1
BOUNDARY_MASK_ALL = 2
BOUNDARY_TRICK_FUSED = 3

LOG2E = 1.4426950408889634
_RAGGED_BILLION: tl.constexpr = tl.constexpr(0x40000000)  # triton.tools.ragged_tma's 2**30


@triton.jit
def _load_rows(src, base_ptr, seq_start, row0, n_rows, col0, stride_t,
               BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr,
               MASKED: tl.constexpr):
    """Rows [row0, row0 + BLOCK) of one head of one sequence; rows >= n_rows read as 0.
    USE_TMA: 0 = masked pointer loads, 1 = a per-sequence device-side descriptor, 2 = one
    host-side ragged descriptor for the whole jagged tensor (triton.tools.ragged_tma)."""
    if USE_TMA == 1:
        return src.load([row0, col0])
    elif USE_TMA == 2:
        # ragged_tma's indexing: rows past n_rows fall outside the descriptor's bounds
        x = tl.load_tensor_descriptor(src, [_RAGGED_BILLION, seq_start + n_rows,
                                            _RAGGED_BILLION - n_rows + row0, col0])
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
def _store_rows(dst, base_ptr, seq_start, row0, n_rows, col0, stride_t, value,
                BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    if USE_TMA == 1:
        dst.store([row0, col0], value)
    elif USE_TMA == 2:
        tl.store_tensor_descriptor(dst, [_RAGGED_BILLION, seq_start + n_rows,
                                         _RAGGED_BILLION - n_rows + row0, col0],
                                   tl.reshape(value, [1, 1, BLOCK, HEAD_DIM]))
    else:
        rows = row0 + tl.arange(0, BLOCK)
        cols = col0 + tl.arange(0, HEAD_DIM)
        ptrs = base_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :]
        tl.store(ptrs, value, mask=rows[:, None] < n_rows)


@triton.jit
def _make_src(desc, base_ptr, n_rows, stride_t, H_D, BLOCK: tl.constexpr,
              HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """What _load_rows/_store_rows take: a descriptor over one sequence's rows (all heads side
    by side), the host's ragged descriptor, or the sequence's base pointer."""
    if USE_TMA == 1:
        return tl.make_tensor_descriptor(base_ptr, shape=[n_rows, H_D], strides=[stride_t, 1],
                                         block_shape=[BLOCK, HEAD_DIM])
    elif USE_TMA == 2:
        return desc
    else:
        return base_ptr


@triton.jit
def _band_mask(offs_m, offs_n, L, WL, WR, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               CHECK_END: tl.constexpr):
    mask = offs_n[None, :] >= 0
    if CHECK_END:
        mask = mask & (offs_n[None, :] < L)
    if CAUSAL:
        mask = mask & (offs_n[None, :] <= offs_m[:, None])
    if HAS_WINDOW:
        mask = mask & (offs_n[None, :] >= offs_m[:, None] - WL)
        mask = mask & (offs_n[None, :] <= offs_m[:, None] + WR)
    return mask


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, k_base, v_base, seq_start, lo, hi, L, col0,
               stride_k, stride_v, offs_m, qk_scale, WL, WR,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MODE: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, USE_TMA: tl.constexpr):
    """Key tiles [lo, hi) step BLOCK_N. MODE 0: no mask; 1: band mask (with the sequence end);
    2: the sequence-end tile by the boundary trick (guarded per tile); 3: every tile of the
    sequence by the boundary trick, unguarded (the caller checks once after the loop)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        k = _load_rows(k_src, k_base, seq_start, start_n, L, col0, stride_k, BLOCK_N, HEAD_DIM,
                       USE_TMA, (MODE != 0) and ((MODE != 3) or (USE_TMA == 0)))
        qk = tl.dot(q, tl.trans(k))
        if MODE == 0:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            l_ij = tl.sum(p, 1)
        elif MODE == 3:
            # fused trick: every tile unmasked; only a tile past the sequence end has
            # n_pad > 0 (then its zero-filled keys added exactly n_pad * exp2(0 - m_ij))
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            n_pad = tl.maximum(start_n + BLOCK_N - L, 0).to(tl.float32)
            l_ij = tl.sum(p, 1) - n_pad * tl.math.exp2(-m_ij)
        elif MODE == 2:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            l_raw = tl.sum(p, 1)
            n_pad = (start_n + BLOCK_N - L).to(tl.float32)
            l_ij = l_raw - n_pad * tl.math.exp2(-m_ij)
            # Exactness guard: the subtraction loses ~eps * l_raw; redo the tile with the mask
            # when that is more than ~2^8 eps of the row's new total.
            l_new = l_i * tl.math.exp2(m_i - m_ij) + l_ij
            bad = tl.max((l_raw > 256.0 * l_new).to(tl.int32), 0)
            if bad != 0:
                offs_n = start_n + offs_n0
                s = tl.where(offs_n[None, :] < L, qk * qk_scale, -1.0e6)
                m_ij = tl.maximum(m_i, tl.max(s, 1))
                p = tl.math.exp2(s - m_ij[:, None])
                l_ij = tl.sum(p, 1)
        else:
            offs_n = start_n + offs_n0
            mask = _band_mask(offs_m, offs_n, L, WL, WR, CAUSAL, HAS_WINDOW, True)
            s = tl.where(mask, qk * qk_scale, -1.0e6)
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_ij[:, None])
            l_ij = tl.sum(p, 1)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + l_ij
        acc = acc * alpha[:, None]
        v = _load_rows(v_src, v_base, seq_start, start_n, L, col0, stride_v, BLOCK_N, HEAD_DIM,
                       USE_TMA, (MODE != 0) and ((MODE != 3) or (USE_TMA == 0)))
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _jfa_fwd_kernel(Q, K, V, Out, Qd, Kd, Vd, Od, LSE, offsets, sched, n_sched, total_tokens,
                    qk_scale,
                    stride_q, stride_k, stride_v, stride_o, H, WL, WR,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BOUNDARY: tl.constexpr,
                    USE_TMA: tl.constexpr):
    h = tl.program_id(0)
    pid = tl.program_id(1)
    seq = tl.load(sched + pid)
    if seq < 0:
        return
    qblk = tl.load(sched + n_sched + pid)
    start = tl.load(offsets + seq).to(tl.int64)
    L = (tl.load(offsets + seq + 1) - start).to(tl.int32)
    m0 = qblk * BLOCK_M
    col0 = h * HEAD_DIM
    H_D = H * HEAD_DIM

    q_base = Q + start * stride_q
    k_base = K + start * stride_k
    v_base = V + start * stride_v
    o_base = Out + start * stride_o
    start32 = start.to(tl.int32)
    q_src = _make_src(Qd, q_base, L, stride_q, H_D, BLOCK_M, HEAD_DIM, USE_TMA)
    k_src = _make_src(Kd, k_base, L, stride_k, H_D, BLOCK_N, HEAD_DIM, USE_TMA)
    v_src = _make_src(Vd, v_base, L, stride_v, H_D, BLOCK_N, HEAD_DIM, USE_TMA)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_last = tl.minimum(m0 + BLOCK_M, L) - 1  # last real query row of this block

    # Key range [lo, hi) that any real row of this block may see.
    hi = L
    lo = 0
    if CAUSAL:
        hi = tl.minimum(hi, m_last + 1)
    if HAS_WINDOW:
        hi = tl.minimum(hi, m_last + WR + 1)
        lo = tl.maximum(m0 - WL, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    # Tiles [full_lo, full_hi) are fully valid for every row of the block.
    full_hi = (L // BLOCK_N) * BLOCK_N
    full_lo = lo
    if CAUSAL:
        full_hi = tl.minimum(full_hi, ((m0 + 1) // BLOCK_N) * BLOCK_N)
    if HAS_WINDOW:
        full_hi = tl.minimum(full_hi, ((m0 + WR + 1) // BLOCK_N) * BLOCK_N)
        full_lo = tl.maximum(full_lo, tl.cdiv(tl.maximum(m_last - WL, 0), BLOCK_N) * BLOCK_N)
    if BOUNDARY == 2 or ((not CAUSAL) and (not HAS_WINDOW) and BOUNDARY == 3):  # one loop
        full_hi = lo
        full_lo = lo
    if full_hi <= full_lo:
        full_lo = lo
        full_hi = lo

    q = _load_rows(q_src, q_base, start32, m0, L, col0, stride_q, BLOCK_M, HEAD_DIM, USE_TMA,
                   True)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if HAS_WINDOW:  # left band edge
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, k_base, v_base, start32,
                                   lo, full_lo,
                                   L, col0, stride_k, stride_v, offs_m, qk_scale, WL, WR,
                                   BLOCK_N, HEAD_DIM, 1, CAUSAL, HAS_WINDOW, USE_TMA)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, k_base, v_base, start32,
                                   full_lo, full_hi,
                               L, col0, stride_k, stride_v, offs_m, qk_scale, WL, WR,
                               BLOCK_N, HEAD_DIM, 0, CAUSAL, HAS_WINDOW, USE_TMA)
    if (not CAUSAL) and (not HAS_WINDOW) and BOUNDARY == 3:
        # One uniform loop over all key tiles, no mask anywhere (loads past the end are 0).
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, k_base, v_base, start32,
                                   lo, hi,
                                   L, col0, stride_k, stride_v, offs_m, qk_scale, WL, WR,
                                   BLOCK_N, HEAD_DIM, 3, CAUSAL, HAS_WINDOW, USE_TMA)
        # Exactness guard, once: the spurious mass was added at the last tile, under the final
        # m_i; if it outweighs the row's true sum by > 2^8 (every real score of the row far
        # below 0), redo this block with the mask.
        n_pad_last = (tl.cdiv(L, BLOCK_N) * BLOCK_N - L).to(tl.float32)
        spur = n_pad_last * tl.math.exp2(-m_i)
        bad = tl.max(((spur > 256.0 * l_i) & (offs_m < L)).to(tl.int32), 0)
        if bad != 0:
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, k_base, v_base,
                                       start32, lo, hi,
                                       L, col0, stride_k, stride_v, offs_m, qk_scale, WL, WR,
                                       BLOCK_N, HEAD_DIM, 1, CAUSAL, HAS_WINDOW, USE_TMA)
    elif (not CAUSAL) and (not HAS_WINDOW) and BOUNDARY == 1:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, k_base, v_base, start32,
                                   full_hi, hi,
                                   L, col0, stride_k, stride_v, offs_m, qk_scale, WL, WR,
                                   BLOCK_N, HEAD_DIM, 2, CAUSAL, HAS_WINDOW, USE_TMA)
    else:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, k_base, v_base, start32,
                                   full_hi, hi,
                                   L, col0, stride_k, stride_v, offs_m, qk_scale, WL, WR,
                                   BLOCK_N, HEAD_DIM, 1, CAUSAL, HAS_WINDOW, USE_TMA)

    # Epilogue. Rows that saw no valid key keep m_i <= -1e6: output 0, LSE = +inf.
    has_key = m_i > -1.0e5
    l_safe = tl.where(has_key, l_i, 1.0)
    out = tl.where(has_key[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(has_key, m_i + tl.math.log2(l_safe), float("inf"))
    o_dst = _make_src(Od, o_base, L, stride_o, H_D, BLOCK_M, HEAD_DIM, USE_TMA)
    _store_rows(o_dst, o_base, start32, m0, L, col0, stride_o, out.to(Out.dtype.element_ty),
                BLOCK_M, HEAD_DIM, USE_TMA)
    tl.store(LSE + h.to(tl.int64) * total_tokens + start + offs_m, lse, mask=offs_m < L)
