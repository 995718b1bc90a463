"""Jagged flash attention backward in Triton: dq, dk, dv without materialising the attention
matrix, no padding, no atomics (so always deterministic).

* ``_jfa_bwd_delta_kernel``: delta = rowsum(O * dO), (heads, total_tokens) fp32.
* ``_jfa_bwd_dkdv_kernel``: one program per (sequence, key block, head); walks the query blocks
  that can see its keys, accumulating dK = scale * dS^T Q and dV = P^T dO.
* ``_jfa_bwd_dq_kernel``: one program per (sequence, query block, head); walks the key blocks,
  accumulating dQ = scale * dS K.

P is rebuilt from the forward's base-2 LSE. Sequence ends need no masks here except one: query
rows past the end load as zeros (dO too) with LSE = +inf and delta = 0, so they add exactly 0 to
dK and dV; key rows past the end load as zeros, so they add exactly 0 to dQ, but their P is
exp2(-LSE), unbounded in principle, so the dq kernel masks its one partial key tile. Only the
causal diagonal and window edges are masked otherwise.
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


@triton.jit(do_not_specialize=["total_tokens"])
def _jfa_bwd_delta_kernel(Out, DO, DELTA, total_tokens, stride_o, stride_do, H,
                          HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    cols = h * HEAD_DIM + tl.arange(0, HEAD_DIM)
    mask = rows[:, None] < total_tokens
    o = tl.load(Out + rows[:, None].to(tl.int64) * stride_o + cols[None, :], mask=mask, other=0.0)
    do = tl.load(DO + rows[:, None].to(tl.int64) * stride_do + cols[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + h.to(tl.int64) * total_tokens + rows, delta, mask=rows < total_tokens)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_src, do_src, q_base, do_base, seq_start, lse_ptr, delta_ptr, lo,
                hi, L,
                col0, stride_q, stride_do, offs_n, qk_scale, WL, WR,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, USE_TMA: tl.constexpr):
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        q = load_rows(q_src, q_base, seq_start, start_m, L, col0, stride_q, BLOCK_M, HEAD_DIM,
                       USE_TMA, True)
        lse = tl.load(lse_ptr + offs_m, mask=offs_m < L, other=float("inf"))
        qkT = tl.dot(k, tl.trans(q))  # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
        if MASKED:
            # mask[j, i] for key j (rows) and query i (columns)
            maskT = offs_n[:, None] >= 0
            if CAUSAL:
                maskT = maskT & (offs_n[:, None] <= offs_m[None, :])
            if HAS_WINDOW:
                maskT = maskT & (offs_n[:, None] >= offs_m[None, :] - WL)
                maskT = maskT & (offs_n[:, None] <= offs_m[None, :] + WR)
            pT = tl.where(maskT, pT, 0.0)
        do = load_rows(do_src, do_base, seq_start, start_m, L, col0, stride_do, BLOCK_M,
                        HEAD_DIM, USE_TMA, True)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        delta = tl.load(delta_ptr + offs_m, mask=offs_m < L, other=0.0)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.jit(do_not_specialize=["n_sched", "total_tokens"])
def _jfa_bwd_dkdv_kernel(Q, K, V, DO, DK, DV, Qd, Kd, Vd, DOd, DKd, DVd, LSE, DELTA, offsets,
                         sched, n_sched, total_tokens,
                         sm_scale, qk_scale, stride_q, stride_k, stride_v, stride_do, stride_dk,
                         stride_dv, H, WL, WR,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, USE_TMA: tl.constexpr):
    h = tl.program_id(0)
    seq, kblk, start, L = sequence_block(sched, n_sched, offsets)
    if seq < 0:
        return
    n0 = kblk * BLOCK_N
    col0 = h * HEAD_DIM
    H_D = H * HEAD_DIM
    q_base = Q + start * stride_q
    k_base = K + start * stride_k
    v_base = V + start * stride_v
    do_base = DO + start * stride_do
    start32 = start.to(tl.int32)
    q_src = make_src(Qd, q_base, L, stride_q, H_D, BLOCK_M, HEAD_DIM, USE_TMA)
    do_src = make_src(DOd, do_base, L, stride_do, H_D, BLOCK_M, HEAD_DIM, USE_TMA)
    k_src = make_src(Kd, k_base, L, stride_k, H_D, BLOCK_N, HEAD_DIM, USE_TMA)
    v_src = make_src(Vd, v_base, L, stride_v, H_D, BLOCK_N, HEAD_DIM, USE_TMA)
    lse_ptr = LSE + h.to(tl.int64) * total_tokens + start
    delta_ptr = DELTA + h.to(tl.int64) * total_tokens + start

    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_last = tl.minimum(n0 + BLOCK_N, L) - 1
    # Query rows [q_lo, q_hi) that may see a key of this block.
    q_lo = 0
    q_hi = L
    if CAUSAL:
        q_lo = n0
    if HAS_WINDOW:
        q_lo = tl.maximum(q_lo, n0 - WR)
        q_hi = tl.minimum(q_hi, n_last + WL + 1)
    q_lo = (q_lo // BLOCK_M) * BLOCK_M
    # Query tiles with start in [full_lo, full_hi) see every key of the block.
    full_lo = q_lo
    full_hi = tl.cdiv(q_hi, BLOCK_M) * BLOCK_M
    if CAUSAL:
        full_lo = tl.maximum(full_lo, tl.cdiv(n_last, BLOCK_M) * BLOCK_M)
    if HAS_WINDOW:
        full_lo = tl.maximum(full_lo, tl.cdiv(tl.maximum(n_last - WR, 0), BLOCK_M) * BLOCK_M)
        lim = n0 + WL - BLOCK_M + 1  # largest allowed tile start
        full_hi = tl.minimum(full_hi, tl.where(lim >= 0, (lim // BLOCK_M) * BLOCK_M + BLOCK_M, 0))
    if full_hi <= full_lo:  # no full tile: the left (masked) loop takes them all
        full_lo = tl.cdiv(q_hi, BLOCK_M) * BLOCK_M
        full_hi = full_lo

    k = load_rows(k_src, k_base, start32, n0, L, col0, stride_k, BLOCK_N, HEAD_DIM, USE_TMA,
                   True)
    v = load_rows(v_src, v_base, start32, n0, L, col0, stride_v, BLOCK_N, HEAD_DIM, USE_TMA,
                   True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if CAUSAL or HAS_WINDOW:
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_src, do_src, q_base, do_base, start32, lse_ptr,
                             delta_ptr,
                             q_lo, full_lo, L, col0, stride_q, stride_do, offs_n, qk_scale, WL,
                             WR, BLOCK_M, HEAD_DIM, True, CAUSAL, HAS_WINDOW, USE_TMA)
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_src, do_src, q_base, do_base, start32, lse_ptr,
                             delta_ptr,
                         full_lo, full_hi, L, col0, stride_q, stride_do, offs_n, qk_scale, WL, WR,
                         BLOCK_M, HEAD_DIM, False, CAUSAL, HAS_WINDOW, USE_TMA)
    if HAS_WINDOW:
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_src, do_src, q_base, do_base, start32, lse_ptr,
                             delta_ptr,
                             full_hi, q_hi, L, col0, stride_q, stride_do, offs_n, qk_scale, WL,
                             WR, BLOCK_M, HEAD_DIM, True, CAUSAL, HAS_WINDOW, USE_TMA)
    dk = dk * sm_scale
    dk_dst = make_src(DKd, DK + start * stride_dk, L, stride_dk, H_D, BLOCK_N, HEAD_DIM, USE_TMA)
    dv_dst = make_src(DVd, DV + start * stride_dv, L, stride_dv, H_D, BLOCK_N, HEAD_DIM, USE_TMA)
    store_rows(dk_dst, DK + start * stride_dk, start32, n0, L, col0, stride_dk,
                dk.to(DK.dtype.element_ty), BLOCK_N, HEAD_DIM, USE_TMA)
    store_rows(dv_dst, DV + start * stride_dv, start32, n0, L, col0, stride_dv,
                dv.to(DV.dtype.element_ty), BLOCK_N, HEAD_DIM, USE_TMA)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_src, v_src, k_base, v_base, seq_start, lo, hi, L, col0,
              stride_k,
              stride_v, offs_m, qk_scale, WL, WR,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, USE_TMA: tl.constexpr):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        k = load_rows(k_src, k_base, seq_start, start_n, L, col0, stride_k, BLOCK_N, HEAD_DIM,
                       USE_TMA, MASKED)
        v = load_rows(v_src, v_base, seq_start, start_n, L, col0, stride_v, BLOCK_N, HEAD_DIM,
                       USE_TMA, MASKED)
        qk = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASKED:
            offs_n = start_n + offs_n0
            p = tl.where(band_mask(offs_m, offs_n, L, WL, WR, CAUSAL, HAS_WINDOW, True), p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit(do_not_specialize=["n_sched", "total_tokens"])
def _jfa_bwd_dq_kernel(Q, K, V, DO, DQ, Qd, Kd, Vd, DOd, DQd, LSE, DELTA, offsets, sched,
                       n_sched, total_tokens,
                       sm_scale, qk_scale, stride_q, stride_k, stride_v, stride_do, stride_dq,
                       H, WL, WR,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, USE_TMA: tl.constexpr):
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
    do_base = DO + start * stride_do
    start32 = start.to(tl.int32)
    q_src = make_src(Qd, q_base, L, stride_q, H_D, BLOCK_M, HEAD_DIM, USE_TMA)
    do_src = make_src(DOd, do_base, L, stride_do, H_D, BLOCK_M, HEAD_DIM, USE_TMA)
    k_src = make_src(Kd, k_base, L, stride_k, H_D, BLOCK_N, HEAD_DIM, USE_TMA)
    v_src = make_src(Vd, v_base, L, stride_v, H_D, BLOCK_N, HEAD_DIM, USE_TMA)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    lo, hi, full_lo, full_hi = query_block_key_range(m0, L, WL, WR, BLOCK_M, BLOCK_N, CAUSAL,
                                                     HAS_WINDOW)

    q = load_rows(q_src, q_base, start32, m0, L, col0, stride_q, BLOCK_M, HEAD_DIM, USE_TMA,
                   True)
    do = load_rows(do_src, do_base, start32, m0, L, col0, stride_do, BLOCK_M, HEAD_DIM, USE_TMA,
                    True)
    row_ok = offs_m < L
    lse = tl.load(LSE + h.to(tl.int64) * total_tokens + start + offs_m, mask=row_ok,
                  other=float("inf"))
    delta = tl.load(DELTA + h.to(tl.int64) * total_tokens + start + offs_m, mask=row_ok,
                    other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if HAS_WINDOW:
        dq = _dq_tiles(dq, q, do, lse, delta, k_src, v_src, k_base, v_base, start32, lo, full_lo, L,
                       col0,
                       stride_k, stride_v, offs_m, qk_scale, WL, WR, BLOCK_N, HEAD_DIM, True,
                       CAUSAL, HAS_WINDOW, USE_TMA)
    dq = _dq_tiles(dq, q, do, lse, delta, k_src, v_src, k_base, v_base, start32, full_lo, full_hi,
                   L, col0,
                   stride_k, stride_v, offs_m, qk_scale, WL, WR, BLOCK_N, HEAD_DIM, False,
                   CAUSAL, HAS_WINDOW, USE_TMA)
    dq = _dq_tiles(dq, q, do, lse, delta, k_src, v_src, k_base, v_base, start32, full_hi, hi, L,
                   col0,
                   stride_k, stride_v, offs_m, qk_scale, WL, WR, BLOCK_N, HEAD_DIM, True,
                   CAUSAL, HAS_WINDOW, USE_TMA)
    dq = dq * sm_scale
    dq_dst = make_src(DQd, DQ + start * stride_dq, L, stride_dq, H_D, BLOCK_M, HEAD_DIM, USE_TMA)
    store_rows(dq_dst, DQ + start * stride_dq, start32, m0, L, col0, stride_dq,
                dq.to(DQ.dtype.element_ty), BLOCK_M, HEAD_DIM, USE_TMA)
