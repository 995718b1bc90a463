"""Jagged flash attention forward in Triton: no padding, one program per (sequence, query block,
head), long sequences first (see schedule.py).

Tiles are loaded through per-sequence tensor descriptors (TMA on Hopper): the descriptor's shape
ends at the sequence's last row, so rows past it load as zeros and stores past it are dropped.
Key tiles fall in three ranges per query block:

* full tiles, inside the sequence and inside the causal/window band for every query row: no
  masking at all;
* band tiles (causal diagonal, window edges): an explicit ``tl.where`` mask;
* with neither causal nor window, the one partial tile at the sequence end. BOUNDARY selects how
  it is handled (op.default_boundary picks by head dim; jagged_attention/DESIGN.md says why):
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
    redoes the block with the mask if needed. Default for d <= 64;
  - ``BOUNDARY_WHERE``: full tiles in one loop, the partial tile with a ``tl.where`` mask;
  - ``BOUNDARY_MASK_ALL``: one loop that masks every tile (a naive kernel). Default for d=128,
    where the mask's element-wise work hides under the larger matmuls.

The row log-sum-exp is written in base 2 and scaled units (``m + log2(l)`` with scores
``qk * scale * log2(e)``) for the backward pass; rows with no valid key get output 0 and
LSE = +inf (so the backward gives them no gradient).
"""

from __future__ import annotations

import triton
import triton.language as tl

from gem_kernels.jagged_attention.triton_common import (
    band_mask,
    load_rows,
    make_src,
    query_block_key_range,
    sequence_block,
    store_rows,
)

BOUNDARY_WHERE = 0
BOUNDARY_TRICK = 1
BOUNDARY_MASK_ALL = 2
BOUNDARY_TRICK_FUSED = 3


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
        k = load_rows(k_src, k_base, seq_start, start_n, L, col0, stride_k, BLOCK_N, HEAD_DIM,
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
            mask = band_mask(offs_m, offs_n, L, WL, WR, CAUSAL, HAS_WINDOW, True)
            s = tl.where(mask, qk * qk_scale, -1.0e6)
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_ij[:, None])
            l_ij = tl.sum(p, 1)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + l_ij
        acc = acc * alpha[:, None]
        v = load_rows(v_src, v_base, seq_start, start_n, L, col0, stride_v, BLOCK_N, HEAD_DIM,
                       USE_TMA, (MODE != 0) and ((MODE != 3) or (USE_TMA == 0)))
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    return acc, l_i, m_i


# Longer than 80 lines on purpose: the query tile, the running max / sum and the TMA
# descriptors live in registers through the masked and unmasked key loops; the loops already
# sit in a helper, and splitting the rest would only move register state across calls in the
# kernel whose speed is tuned as it stands.
@triton.jit(do_not_specialize=["n_sched", "total_tokens"])
def _jfa_fwd_kernel(Q, K, V, Out, Qd, Kd, Vd, Od, LSE, offsets, sched, n_sched, total_tokens,
                    qk_scale,
                    stride_q, stride_k, stride_v, stride_o, H, WL, WR,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BOUNDARY: tl.constexpr,
                    USE_TMA: tl.constexpr):
    h = tl.program_id(0)
    seq, qblk, start, L = sequence_block(sched, n_sched, offsets)
    if seq < 0:
        return
    m0 = qblk * BLOCK_M
    col0 = h * HEAD_DIM
    H_D = H * HEAD_DIM

    q_base = Q + start * stride_q
    k_base = K + start * stride_k
    v_base = V + start * stride_v
    o_base = Out + start * stride_o
    start32 = start.to(tl.int32)
    q_src = make_src(Qd, q_base, L, stride_q, H_D, BLOCK_M, HEAD_DIM, USE_TMA)
    k_src = make_src(Kd, k_base, L, stride_k, H_D, BLOCK_N, HEAD_DIM, USE_TMA)
    v_src = make_src(Vd, v_base, L, stride_v, H_D, BLOCK_N, HEAD_DIM, USE_TMA)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    # Key range [lo, hi) that any real row of this block may see; tiles [full_lo, full_hi)
    # are fully valid for every row of the block.
    lo, hi, full_lo, full_hi = query_block_key_range(m0, L, WL, WR, BLOCK_M, BLOCK_N, CAUSAL,
                                                     HAS_WINDOW)
    if BOUNDARY == 2 or ((not CAUSAL) and (not HAS_WINDOW) and BOUNDARY == 3):  # one loop
        full_hi = lo
        full_lo = lo

    q = load_rows(q_src, q_base, start32, m0, L, col0, stride_q, BLOCK_M, HEAD_DIM, USE_TMA,
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
    o_dst = make_src(Od, o_base, L, stride_o, H_D, BLOCK_M, HEAD_DIM, USE_TMA)
    store_rows(o_dst, o_base, start32, m0, L, col0, stride_o, out.to(Out.dtype.element_ty),
                BLOCK_M, HEAD_DIM, USE_TMA)
    tl.store(LSE + h.to(tl.int64) * total_tokens + start + offs_m, lse, mask=offs_m < L)
