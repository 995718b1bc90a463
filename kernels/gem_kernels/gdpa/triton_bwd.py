"""GDPA backward Triton kernels and their launchers.

With S = scale Q K^T, P = act(S), O = P V (times the norm factor c):
  dV = c P^T dO,   dP = c dO V^T,   dS = dP * act'(S),   dQ = scale dS K,   dK = scale dS^T Q.
No softmax means no row statistics to save or recompute (no logsumexp, no rowsum(dO * O)).

Launch plans (gem_kernels.gdpa.op.BackwardMode picks one; which ones are deterministic is
stated per launcher):
- two kernels, each owning its outputs (no atomics): dK/dV over key blocks (an item is
  (sample, key block, head) looping over the sample's query blocks) and dQ over query blocks;
- one pass over key blocks (dK/dV kernel with a DqMode): dQ stored directly when one key block
  holds a sample's whole KV, else its partials summed by fp32 atomics (one launch) or in three
  phases (first / middle / last key blocks);
- fused kernels for a side that fits one tile (short KV, short Q): the long side's gradients
  stored, the short side's partials added into an fp32 buffer by atomics.
Every kernel uses the snake-dealt persistent schedule (gem_kernels.gdpa.schedule).
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from gem_kernels.gdpa.activations import act_fwd_and_grad, out_scale, scale_args
from gem_kernels.gdpa.triton_common import (
    TileConfig,
    add_ragged_rows,
    dot_precision,
    load_meta,
    load_ragged_rows,
    load_rows,
    norm_factor,
    pow2_at_least,
    program_items,
    ragged_desc,
    store_ragged_rows,
    store_rows,
    tile_rows,
    tma_ok,
)


class DqMode(enum.IntEnum):
    """What the dK/dV kernel (_gdpa_dkdv_kernel, its WITH_DQ) does with dQ."""

    NONE = 0  # nothing: a separate dQ kernel computes it (two-kernel plan)
    STORE = 1  # store each query tile's dQ: the item's key block holds all of its sample's keys
    ATOMIC = 2  # add each tile's partial dQ into a zeroed fp32 buffer by atomics
    PHASE_FIRST = 3  # phased plan, first key block: store the partial (or finished) dQ
    PHASE_LAST = 4  # phased plan, last key block: add the fp32 partial sum, store dQ
    PHASE_LAST_HOISTED = 5  # PHASE_LAST with the partial's load outside the software pipeline


# The same values for the kernels (Triton reads a global only as a tl.constexpr).
_DQ_NONE = tl.constexpr(int(DqMode.NONE))
_DQ_STORE = tl.constexpr(int(DqMode.STORE))
_DQ_ATOMIC = tl.constexpr(int(DqMode.ATOMIC))
_DQ_PHASE_FIRST = tl.constexpr(int(DqMode.PHASE_FIRST))
_DQ_PHASE_LAST = tl.constexpr(int(DqMode.PHASE_LAST))
_DQ_PHASE_LAST_HOISTED = tl.constexpr(int(DqMode.PHASE_LAST_HOISTED))


def dkdv_config(max_q: int, max_kv: int, head_dim: int) -> TileConfig:
    """dK/dV kernel of the two-kernel plan: rows are key blocks, columns query blocks."""
    if max_kv <= 64:
        return TileConfig(pow2_at_least(max_kv, 16, 64), 64, num_warps=4, num_stages=2,
                          ctas_per_sm=2)
    if max_q <= 32:
        return TileConfig(64, pow2_at_least(max_q, 16, 32), num_warps=4, num_stages=1,
                          ctas_per_sm=2)
    return TileConfig(64, 32, num_warps=4, num_stages=3, ctas_per_sm=2, prefetch=False)


def dq_config(max_q: int, max_kv: int, head_dim: int) -> TileConfig:
    """dQ kernel of the two-kernel plan: rows are query blocks, columns key blocks."""
    if max_kv <= 64:
        return TileConfig(64, pow2_at_least(max_kv, 16, 64), num_warps=4, num_stages=1,
                          ctas_per_sm=2)
    if max_q <= 32:
        return TileConfig(pow2_at_least(max_q, 16, 32), 64, num_warps=4, num_stages=2,
                          ctas_per_sm=2)
    return TileConfig(64, 32, num_warps=4, num_stages=3, ctas_per_sm=2, prefetch=False)


def one_pass_config(max_q: int, max_kv: int, head_dim: int) -> TileConfig:
    """One-pass backward: rows are key blocks (8 warps, 128 keys), columns 32-row query tiles,
    dQ computed transposed (a warpgroup MMA on Hopper)."""
    return TileConfig(128, 32, num_warps=8, num_stages=3, ctas_per_sm=1, prefetch=False,
                      dq_transposed=True)


def short_kv_config(max_kv: int, head_dim: int) -> TileConfig:
    """Fused backward with rows = query blocks, the whole KV of a sample in one column tile."""
    return TileConfig(64, pow2_at_least(max_kv, 16, 64), num_warps=4, num_stages=1,
                      ctas_per_sm=2)


def short_kv_stream_config(max_kv: int, head_dim: int) -> TileConfig:
    """One-pass backward with rows = a sample's whole KV, columns = its 32-row query tiles."""
    return TileConfig(pow2_at_least(max_kv, 16, 64), 32, num_warps=4, num_stages=3,
                      ctas_per_sm=2, prefetch=False)


def short_q_stream_config(max_q: int, head_dim: int) -> TileConfig:
    """One-pass backward with rows = a sample's whole Q, columns = its 64-row key blocks
    (8 warps, 3 stages: see gdpa/DESIGN.md)."""
    return TileConfig(pow2_at_least(max_q, 16, 64), 64, num_warps=8, num_stages=3,
                      ctas_per_sm=2, prefetch=False)


def short_q_config(max_q: int, head_dim: int) -> TileConfig:
    """Fused backward with rows = key blocks, the whole Q of a sample in one column tile."""
    return TileConfig(64, pow2_at_least(max_q, 16, 64), num_warps=4, num_stages=1,
                      ctas_per_sm=2)


@triton.jit
def _atomic_add_rows(ptr, x, start, length, h, stride_t, stride_h, BLOCK: tl.constexpr,
                     D: tl.constexpr):
    """Adds a (BLOCK, D) fp32 tile into rows start.. of one head (rows past length skipped;
    their addresses are clamped into the sample so that no lane ever points past it)."""
    if length > 0:
        rows = tl.arange(0, BLOCK)
        valid = rows < length
        rows = tl.where(valid, rows, 0)
        offs = (start + rows).to(tl.int64)[:, None] * stride_t + h * stride_h \
            + tl.arange(0, D)[None, :]
        tl.atomic_add(ptr + offs, x, mask=valid[:, None], sem="relaxed")


@triton.jit
def _gdpa_bwd_short_kv_kernel(Q, K, V, DO, DQ, DK32, DV32, items, prog_ptr,
                              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                              stride_vh, stride_dot, stride_doh, scale, inv_max_kv,
                              ACT: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr,
                              BM: tl.constexpr, BS: tl.constexpr, PREFETCH: tl.constexpr,
                              PREC: tl.constexpr, FOLD: tl.constexpr, CSCALE: tl.constexpr):
    """Items are query blocks; the sample's KV (<= BS rows) is one tile. Stores dQ, adds
    partial dK, dV into fp32 buffers laid out like k / v."""
    start, end = program_items(prog_ptr)
    blk, h, r0, rlen, c0, clen = load_meta(items, start)
    nblk, nh, nr0, nrlen, nc0, nclen = load_meta(items, tl.minimum(start + 1, end - 1))
    q = load_rows(Q, r0, rlen, blk, h, stride_qt, stride_qh, BM, D)
    do = load_rows(DO, r0, rlen, blk, h, stride_dot, stride_doh, BM, D)
    for it in range(start, end):
        mblk, mh, mr0, mrlen, mc0, mclen = load_meta(items, tl.minimum(it + 2, end - 1))
        if PREFETCH:
            q_next = load_rows(Q, nr0, nrlen, nblk, nh, stride_qt, stride_qh, BM, D)
            do_next = load_rows(DO, nr0, nrlen, nblk, nh, stride_dot, stride_doh, BM, D)
        k = load_rows(K, c0, clen, 0, h, stride_kt, stride_kh, BS, D)
        v = load_rows(V, c0, clen, 0, h, stride_vt, stride_vh, BS, D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)  # (BM, BS)
        p, dact = act_fwd_and_grad(s, scale, ACT, FOLD, CSCALE)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = (dp * dact).to(k.dtype)
        c = norm_factor(clen, inv_max_kv, NORM)
        dq = tl.dot(ds, k, input_precision=PREC)
        store_rows(DQ, dq * (c * scale), r0, rlen, blk, h, stride_qt, stride_qh, BM, D)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        dk = tl.dot(tl.trans(ds), q, input_precision=PREC)
        _atomic_add_rows(DV32, dv * (c * out_scale(scale, FOLD)), c0, clen, h, stride_vt,
                         stride_vh, BS, D)
        _atomic_add_rows(DK32, dk * (c * scale), c0, clen, h, stride_kt, stride_kh, BS, D)
        if not PREFETCH:
            q_next = load_rows(Q, nr0, nrlen, nblk, nh, stride_qt, stride_qh, BM, D)
            do_next = load_rows(DO, nr0, nrlen, nblk, nh, stride_dot, stride_doh, BM, D)
        q = q_next
        do = do_next
        blk, h, r0, rlen, c0, clen = nblk, nh, nr0, nrlen, nc0, nclen
        nblk, nh, nr0, nrlen, nc0, nclen = mblk, mh, mr0, mrlen, mc0, mclen


@triton.jit
def _gdpa_bwd_short_q_kernel(Q, K, V, DO, DK, DV, DQ32, items, prog_ptr,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                             stride_vh, stride_dot, stride_doh, scale, inv_max_kv,
                             ACT: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr,
                             BN: tl.constexpr, BS: tl.constexpr, PREFETCH: tl.constexpr,
                             PREC: tl.constexpr, FOLD: tl.constexpr, CSCALE: tl.constexpr):
    """Items are key blocks; the sample's Q (<= BS rows) is one tile. Stores dK, dV, adds
    partial dQ into an fp32 buffer laid out like q."""
    start, end = program_items(prog_ptr)
    blk, h, r0, rlen, c0, clen = load_meta(items, start)
    nblk, nh, nr0, nrlen, nc0, nclen = load_meta(items, tl.minimum(start + 1, end - 1))
    k = load_rows(K, r0, rlen, blk, h, stride_kt, stride_kh, BN, D)
    v = load_rows(V, r0, rlen, blk, h, stride_vt, stride_vh, BN, D)
    for it in range(start, end):
        mblk, mh, mr0, mrlen, mc0, mclen = load_meta(items, tl.minimum(it + 2, end - 1))
        if PREFETCH:
            k_next = load_rows(K, nr0, nrlen, nblk, nh, stride_kt, stride_kh, BN, D)
            v_next = load_rows(V, nr0, nrlen, nblk, nh, stride_vt, stride_vh, BN, D)
        q = load_rows(Q, c0, clen, 0, h, stride_qt, stride_qh, BS, D)
        do = load_rows(DO, c0, clen, 0, h, stride_dot, stride_doh, BS, D)
        st = tl.dot(k, tl.trans(q), input_precision=PREC)  # (BN, BS) = S^T / scale
        pt, dact = act_fwd_and_grad(st, scale, ACT, FOLD, CSCALE)
        c = norm_factor(rlen, inv_max_kv, NORM)  # rows are the sample's keys
        dv = tl.dot(pt.to(do.dtype), do, input_precision=PREC)
        store_rows(DV, dv * (c * out_scale(scale, FOLD)), r0, rlen, blk, h, stride_vt,
                   stride_vh, BN, D)
        dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
        dst = (dpt * dact).to(q.dtype)
        dk = tl.dot(dst, q, input_precision=PREC)
        store_rows(DK, dk * (c * scale), r0, rlen, blk, h, stride_kt, stride_kh, BN, D)
        dq = tl.dot(tl.trans(dst), k, input_precision=PREC)
        _atomic_add_rows(DQ32, dq * (c * scale), c0, clen, h, stride_qt, stride_qh, BS, D)
        if not PREFETCH:
            k_next = load_rows(K, nr0, nrlen, nblk, nh, stride_kt, stride_kh, BN, D)
            v_next = load_rows(V, nr0, nrlen, nblk, nh, stride_vt, stride_vh, BN, D)
        k = k_next
        v = v_next
        blk, h, r0, rlen, c0, clen = nblk, nh, nr0, nrlen, nc0, nclen
        nblk, nh, nr0, nrlen, nc0, nclen = mblk, mh, mr0, mrlen, mc0, mclen


# Longer than 80 lines on purpose: its body is one software-pipelined loop whose prefetched
# K/V tiles and item metadata are carried across iterations in registers; split into helpers,
# the pipeline's stages would cross call boundaries, and the kernel's speed was tuned whole.
@triton.jit
def _gdpa_dkdv_kernel(Q, K, V, DO, DK, DV, DQ, DQ32, items, prog_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_dot, stride_doh, scale, inv_max_kv,
                      ACT: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr,
                      BN: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr,
                      PREFETCH: tl.constexpr, PREC: tl.constexpr, WITH_DQ: tl.constexpr,
                      FOLD: tl.constexpr, CSCALE: tl.constexpr, DQ_T: tl.constexpr):
    """Items are key blocks (rows = keys, columns = queries); dK, dV share k's / v's strides,
    DQ32 (fp32) q's. WITH_DQ (a DqMode) says what happens to dQ:
    NONE: nothing. STORE (short KV: every item's key block holds all of its sample's keys):
    each visited query tile's dQ = c scale dS K is complete and stored into DQ, so the whole
    backward is one pass that reads Q and dO once, with no atomics and no fp32 buffer.
    ATOMIC: each tile's partial dQ is added into the zeroed DQ32 by fp32 atomics (long KV: one
    pass, S and act' computed once; the sum's last bits depend on the order). The phased plan
    runs a sample's key blocks as three launches, so that no fp32 buffer needs zeroing or a
    final cast: PHASE_FIRST (first key block) stores its partial dQ into DQ32, or the finished
    dQ into DQ when the block holds all of the sample's keys; ATOMIC (middle blocks) adds into
    DQ32; PHASE_LAST (last block) adds DQ32's sum to its own partial and stores the finished
    dQ into DQ; PHASE_LAST_HOISTED does the same with DQ32's tile loaded outside the software
    pipeline."""
    start, end = program_items(prog_ptr)
    blk, h, r0, rlen, c0, clen = load_meta(items, start)
    nblk, nh, nr0, nrlen, nc0, nclen = load_meta(items, tl.minimum(start + 1, end - 1))
    k = load_rows(K, r0, rlen, blk, h, stride_kt, stride_kh, BN, D)
    v = load_rows(V, r0, rlen, blk, h, stride_vt, stride_vh, BN, D)
    offs_d = tl.arange(0, D)
    for it in range(start, end):
        mblk, mh, mr0, mrlen, mc0, mclen = load_meta(items, tl.minimum(it + 2, end - 1))
        if PREFETCH:
            k_next = load_rows(K, nr0, nrlen, nblk, nh, stride_kt, stride_kh, BN, D)
            v_next = load_rows(V, nr0, nrlen, nblk, nh, stride_vt, stride_vh, BN, D)
        dk = tl.zeros((BN, D), dtype=tl.float32)
        dv = tl.zeros((BN, D), dtype=tl.float32)
        q_base = Q + h * stride_qh + offs_d[None, :]
        do_base = DO + h * stride_doh + offs_d[None, :]
        for m0 in tl.range(0, clen, BM, num_stages=STAGES):
            crow, cmask = tile_rows(c0, m0, clen, BM)
            q = tl.load(q_base + crow * stride_qt, mask=cmask, other=0.0)
            do = tl.load(do_base + crow * stride_dot, mask=cmask, other=0.0)
            if WITH_DQ == _DQ_PHASE_LAST_HOISTED:
                # Behind a run-time branch the software pipeliner leaves this load alone:
                # issued here, its latency hides behind the tile's five matmuls, so the
                # phase may keep cfg's stages (gdpa/DESIGN.md).
                part = tl.zeros((BM, D), dtype=tl.float32)
                if clen > 0:
                    part = tl.load(DQ32 + crow * stride_qt + h * stride_qh + offs_d[None, :],
                                   mask=cmask, other=0.0)
            st = tl.dot(k, tl.trans(q), input_precision=PREC)  # (BN, BM) = S^T / scale
            pt, dact = act_fwd_and_grad(st, scale, ACT, FOLD, CSCALE)
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
            dst = (dpt * dact).to(q.dtype)
            dk = tl.dot(dst, q, dk, input_precision=PREC)
            if WITH_DQ != _DQ_NONE:
                if DQ_T:
                    # dQ^T = K^T dS^T: 128 rows (the head dim) instead of the query tile's
                    # 32, so Hopper runs it as a warpgroup MMA (wgmma) from the K tile
                    # already in shared memory, where dS K is a 32-row mma.sync product
                    # that also keeps a second, differently laid out copy of K.
                    dq = tl.trans(tl.dot(tl.trans(k), dst, input_precision=PREC))
                else:
                    dq = tl.dot(tl.trans(dst), k, input_precision=PREC)
                dq = dq * (norm_factor(rlen, inv_max_kv, NORM) * scale)
                dq_offs = crow * stride_qt + h * stride_qh + offs_d[None, :]
                if WITH_DQ == _DQ_STORE:
                    tl.store(DQ + dq_offs, dq.to(DQ.dtype.element_ty), mask=cmask)
                elif WITH_DQ == _DQ_ATOMIC:
                    tl.atomic_add(DQ32 + dq_offs, dq, mask=cmask, sem="relaxed")
                elif WITH_DQ == _DQ_PHASE_FIRST:
                    tl.store(DQ + dq_offs, dq.to(DQ.dtype.element_ty),
                             mask=cmask & (rlen <= BN))
                    tl.store(DQ32 + dq_offs, dq, mask=cmask & (rlen > BN))
                elif WITH_DQ == _DQ_PHASE_LAST:
                    part = tl.load(DQ32 + dq_offs, mask=cmask, other=0.0)
                    tl.store(DQ + dq_offs, (dq + part).to(DQ.dtype.element_ty), mask=cmask)
                else:
                    tl.store(DQ + dq_offs, (dq + part).to(DQ.dtype.element_ty), mask=cmask)
        c = norm_factor(rlen, inv_max_kv, NORM)  # rows are the sample's keys
        store_rows(DK, dk * (c * scale), r0, rlen, blk, h, stride_kt, stride_kh, BN, D)
        store_rows(DV, dv * (c * out_scale(scale, FOLD)), r0, rlen, blk, h, stride_vt,
                   stride_vh, BN, D)
        if not PREFETCH:
            k_next = load_rows(K, nr0, nrlen, nblk, nh, stride_kt, stride_kh, BN, D)
            v_next = load_rows(V, nr0, nrlen, nblk, nh, stride_vt, stride_vh, BN, D)
        k = k_next
        v = v_next
        blk, h, r0, rlen, c0, clen = nblk, nh, nr0, nrlen, nc0, nclen
        nblk, nh, nr0, nrlen, nc0, nclen = mblk, mh, mr0, mrlen, mc0, mclen


@triton.jit
def _gdpa_dq_kernel(Q, K, V, DO, DQ, DK, DV, items, prog_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_dot, stride_doh, scale, inv_max_kv,
                    ACT: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr,
                    PREFETCH: tl.constexpr, PREC: tl.constexpr, FOLD: tl.constexpr,
                    CSCALE: tl.constexpr, WITH_DKDV: tl.constexpr):
    """Items are query blocks; dQ shares q's strides. WITH_DKDV (short Q: every item's query
    block holds all of its sample's queries, and samples with keys but no queries have an
    item too) also stores each visited key block's dK and dV, which are then complete: the
    whole backward in one pass over the sample's keys, with no atomics; dK and dV share k's
    and v's strides."""
    start, end = program_items(prog_ptr)
    blk, h, r0, rlen, c0, clen = load_meta(items, start)
    nblk, nh, nr0, nrlen, nc0, nclen = load_meta(items, tl.minimum(start + 1, end - 1))
    q = load_rows(Q, r0, rlen, blk, h, stride_qt, stride_qh, BM, D)
    do = load_rows(DO, r0, rlen, blk, h, stride_dot, stride_doh, BM, D)
    offs_d = tl.arange(0, D)
    for it in range(start, end):
        mblk, mh, mr0, mrlen, mc0, mclen = load_meta(items, tl.minimum(it + 2, end - 1))
        if PREFETCH:
            q_next = load_rows(Q, nr0, nrlen, nblk, nh, stride_qt, stride_qh, BM, D)
            do_next = load_rows(DO, nr0, nrlen, nblk, nh, stride_dot, stride_doh, BM, D)
        dq = tl.zeros((BM, D), dtype=tl.float32)
        k_base = K + h * stride_kh + offs_d[None, :]
        v_base = V + h * stride_vh + offs_d[None, :]
        c = norm_factor(clen, inv_max_kv, NORM)
        for n0 in tl.range(0, clen, BN, num_stages=STAGES):
            crow, cmask = tile_rows(c0, n0, clen, BN)
            k = tl.load(k_base + crow * stride_kt, mask=cmask, other=0.0)
            v = tl.load(v_base + crow * stride_vt, mask=cmask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            p, dact = act_fwd_and_grad(s, scale, ACT, FOLD, CSCALE)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = (dp * dact).to(k.dtype)
            dq = tl.dot(ds, k, dq, input_precision=PREC)
            if WITH_DKDV:
                # Query rows past the sample are 0 (q and dO), so they add nothing here.
                dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
                tl.store(DV + crow * stride_vt + h * stride_vh + offs_d[None, :],
                         (dv * (c * out_scale(scale, FOLD))).to(DV.dtype.element_ty),
                         mask=cmask)
                dk = tl.dot(tl.trans(ds), q, input_precision=PREC)
                tl.store(DK + crow * stride_kt + h * stride_kh + offs_d[None, :],
                         (dk * (c * scale)).to(DK.dtype.element_ty), mask=cmask)
        store_rows(DQ, dq * (c * scale), r0, rlen, blk, h, stride_qt, stride_qh, BM, D)
        if not PREFETCH:
            q_next = load_rows(Q, nr0, nrlen, nblk, nh, stride_qt, stride_qh, BM, D)
            do_next = load_rows(DO, nr0, nrlen, nblk, nh, stride_dot, stride_doh, BM, D)
        q = q_next
        do = do_next
        blk, h, r0, rlen, c0, clen = nblk, nh, nr0, nrlen, nc0, nclen
        nblk, nh, nr0, nrlen, nc0, nclen = mblk, mh, mr0, mrlen, mc0, mclen


@triton.jit
def _gdpa_bwd_one_pass_tma_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc,
                                  DQ, stride_dqt, stride_dqh, items, prog_ptr, scale,
                                  inv_max_kv, ACT: tl.constexpr, NORM: tl.constexpr,
                                  D: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                                  STAGES: tl.constexpr, PREC: tl.constexpr,
                                  FOLD: tl.constexpr, CSCALE: tl.constexpr,
                                  DQ_TMA: tl.constexpr):
    """One pass over key blocks with every tile moved by ragged TMA: rows past a sample load
    as 0, so their S^T, P^T and dS^T entries are 0 without masks. dQ partials go into the
    fp32 buffer by TMA reduce-add (DQ_TMA) or by per-element atomics (the interpreter has no
    TMA reduce)."""
    start, end = program_items(prog_ptr)
    offs_d = tl.arange(0, D)
    for it in range(start, end):
        blk, h, r0, rlen, c0, clen = load_meta(items, it)
        k = load_ragged_rows(k_desc, r0, rlen, blk * BN, h * D, BN, D)
        v = load_ragged_rows(v_desc, r0, rlen, blk * BN, h * D, BN, D)
        c = norm_factor(rlen, inv_max_kv, NORM)  # rows are the sample's keys
        dk = tl.zeros((BN, D), dtype=tl.float32)
        dv = tl.zeros((BN, D), dtype=tl.float32)
        for m0 in tl.range(0, clen, BM, num_stages=STAGES):
            q = load_ragged_rows(q_desc, c0, clen, m0, h * D, BM, D)
            do = load_ragged_rows(do_desc, c0, clen, m0, h * D, BM, D)
            st = tl.dot(k, tl.trans(q), input_precision=PREC)  # (BN, BM) = S^T / scale
            pt, dact = act_fwd_and_grad(st, scale, ACT, FOLD, CSCALE)
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
            dst = (dpt * dact).to(q.dtype)
            dk = tl.dot(dst, q, dk, input_precision=PREC)
            dq = tl.dot(tl.trans(dst), k, input_precision=PREC) * (c * scale)
            if DQ_TMA:
                add_ragged_rows(dq_desc, c0, clen, m0, h * D, dq, BM, D)
            else:
                crow, cmask = tile_rows(c0, m0, clen, BM)
                tl.atomic_add(DQ + crow * stride_dqt + h * stride_dqh + offs_d[None, :], dq,
                              mask=cmask, sem="relaxed")
        store_ragged_rows(dk_desc, r0, rlen, blk * BN, h * D,
                          (dk * (c * scale)).to(dk_desc.dtype), BN, D)
        store_ragged_rows(dv_desc, r0, rlen, blk * BN, h * D,
                          (dv * (c * out_scale(scale, FOLD))).to(dv_desc.dtype), BN, D)


def _launch_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                 dk: torch.Tensor, dv: torch.Tensor, dq: torch.Tensor, dq32: torch.Tensor,
                 sched, cfg: TileConfig, act_code: int, norm_code: int, scale: float,
                 max_kv: int, with_dq: DqMode, stages: int | None = None) -> None:
    """_gdpa_dkdv_kernel over sched's key-block items; with_dq says what it does with dQ,
    stages overrides cfg's pipeline depth."""
    if not sched.num_items:
        return
    stages = cfg.num_stages if stages is None else stages
    fold, cscale = scale_args(act_code, scale, q.dtype, cfg.scale_mode)
    _gdpa_dkdv_kernel[(sched.num_programs,)](
        q, k, v, do, dk, dv, dq, dq32, sched.items, sched.prog_ptr,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), scale, 1.0 / max(max_kv, 1),
        ACT=act_code, NORM=norm_code, D=q.shape[-1], BN=cfg.block_rows, BM=cfg.block_cols,
        STAGES=stages, PREFETCH=cfg.prefetch, PREC=dot_precision(q), WITH_DQ=int(with_dq),
        FOLD=fold, CSCALE=cscale, DQ_T=cfg.dq_transposed, num_warps=cfg.num_warps,
        num_stages=stages)


def launch_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, sched_kv,
               cfg_kv: TileConfig, sched_q, cfg_q: TileConfig, act_code: int, norm_code: int,
               scale: float, max_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two-kernel backward for any lengths: dK/dV over key blocks, then dQ over query blocks.
    (dq, dk, dv) in the inputs' dtypes; every row is written by exactly one item, with no
    atomics: deterministic."""
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    _launch_dkdv(q, k, v, do, dk, dv, dq, dq, sched_kv, cfg_kv, act_code, norm_code, scale,
                 max_kv, with_dq=DqMode.NONE)
    _launch_dq(q, k, v, do, dq, dq, dq, sched_q, cfg_q, act_code, norm_code, scale, max_kv,
               with_dkdv=False)
    return dq, dk, dv


def _launch_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
               dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, sched, cfg: TileConfig,
               act_code: int, norm_code: int, scale: float, max_kv: int, with_dkdv: bool
               ) -> None:
    """_gdpa_dq_kernel over sched's query-block items (with_dkdv: see the kernel)."""
    if not sched.num_items:
        return
    fold, cscale = scale_args(act_code, scale, q.dtype, cfg.scale_mode)
    _gdpa_dq_kernel[(sched.num_programs,)](
        q, k, v, do, dq, dk, dv, sched.items, sched.prog_ptr,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), scale, 1.0 / max(max_kv, 1),
        ACT=act_code, NORM=norm_code, D=q.shape[-1], BM=cfg.block_rows, BN=cfg.block_cols,
        STAGES=cfg.num_stages, PREFETCH=cfg.prefetch, PREC=dot_precision(q),
        FOLD=fold, CSCALE=cscale, WITH_DKDV=with_dkdv, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def launch_bwd_short_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                        sched_q, cfg: TileConfig, act_code: int, norm_code: int, scale: float,
                        max_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward over query blocks for KV samples of at most cfg.block_cols rows: dQ
    stored, dK and dV summed by fp32 atomics (not deterministic)."""
    dq = torch.empty_like(q)
    dk32 = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv32 = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    if sched_q.num_items:
        fold, cscale = scale_args(act_code, scale, q.dtype, cfg.scale_mode)
        _gdpa_bwd_short_kv_kernel[(sched_q.num_programs,)](
            q, k, v, do, dq, dk32, dv32, sched_q.items, sched_q.prog_ptr,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            do.stride(0), do.stride(1), scale, 1.0 / max(max_kv, 1),
            ACT=act_code, NORM=norm_code, D=q.shape[-1], BM=cfg.block_rows,
            BS=cfg.block_cols, PREFETCH=cfg.prefetch, PREC=dot_precision(q),
            FOLD=fold, CSCALE=cscale, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    return dq, dk32.to(k.dtype), dv32.to(v.dtype)


def launch_bwd_short_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                       sched_kv, cfg: TileConfig, act_code: int, norm_code: int, scale: float,
                       max_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward over key blocks for Q samples of at most cfg.block_cols rows: dK and dV
    stored, dQ summed by fp32 atomics (not deterministic)."""
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if sched_kv.num_items:
        fold, cscale = scale_args(act_code, scale, q.dtype, cfg.scale_mode)
        _gdpa_bwd_short_q_kernel[(sched_kv.num_programs,)](
            q, k, v, do, dk, dv, dq32, sched_kv.items, sched_kv.prog_ptr,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            do.stride(0), do.stride(1), scale, 1.0 / max(max_kv, 1),
            ACT=act_code, NORM=norm_code, D=q.shape[-1], BN=cfg.block_rows,
            BS=cfg.block_cols, PREFETCH=cfg.prefetch, PREC=dot_precision(q),
            FOLD=fold, CSCALE=cscale, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    return dq32.to(q.dtype), dk, dv


def launch_bwd_short_q_stream(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              do: torch.Tensor, sched_q, cfg: TileConfig, act_code: int,
                              norm_code: int, scale: float, max_kv: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-pass backward for Q samples of at most cfg.block_rows rows: items are a sample's
    whole Q (one query block) per head, built with cover_empty_rows, and stream its key
    blocks, storing dK, dV per key block and dQ once per item. Every gradient row is written
    exactly once, in the inputs' dtype, with no atomics: deterministic."""
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    _launch_dq(q, k, v, do, dq, dk, dv, sched_q, cfg, act_code, norm_code, scale, max_kv,
               with_dkdv=True)
    # Key rows of samples with no queries belong to an item with no query rows: written 0.
    return dq, dk, dv


def launch_bwd_short_kv_stream(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               do: torch.Tensor, sched_kv, cfg: TileConfig, act_code: int,
                               norm_code: int, scale: float, max_kv: int
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-pass backward for KV samples of at most cfg.block_rows rows: items are a sample's
    whole KV (one key block) per head and stream its query tiles, storing dQ per tile and dK,
    dV once per item. Every gradient row is written exactly once, in the inputs' dtype, with
    no atomics: deterministic."""
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    _launch_dkdv(q, k, v, do, dk, dv, dq, dq, sched_kv, cfg, act_code, norm_code, scale,
                 max_kv, with_dq=DqMode.STORE)
    # Query rows of samples with no KV belong to no item: their gradient is 0.
    return dq, dk, dv


def launch_bwd_one_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                        sched_kv, cfg: TileConfig, act_code: int, norm_code: int,
                        scale: float, max_kv: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Long-KV backward in one kernel over key blocks: dK, dV stored per item, dQ summed by
    fp32 atomics (TMA reduce-add on the TMA path), then cast to q's dtype. Not deterministic:
    the atomics' order changes dQ's last bits."""
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if sched_kv.num_items and cfg.tma and tma_ok(q, k, v, do, dk, dv):
        fold, cscale = scale_args(act_code, scale, q.dtype, cfg.scale_mode)
        bn, bm = cfg.block_rows, cfg.block_cols
        _gdpa_bwd_one_pass_tma_kernel[(sched_kv.num_programs,)](
            ragged_desc(q, bm), ragged_desc(k, bn), ragged_desc(v, bn),
            ragged_desc(do, bm), ragged_desc(dk, bn), ragged_desc(dv, bn),
            ragged_desc(dq32, bm), dq32, dq32.stride(0), dq32.stride(1), sched_kv.items,
            sched_kv.prog_ptr, scale, 1.0 / max(max_kv, 1), ACT=act_code, NORM=norm_code,
            D=q.shape[-1], BN=bn, BM=bm, STAGES=cfg.num_stages, PREC=dot_precision(q),
            FOLD=fold, CSCALE=cscale, DQ_TMA=q.is_cuda, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        return dq32.to(q.dtype), dk, dv
    _launch_dkdv(q, k, v, do, dk, dv, dq32, dq32, sched_kv, cfg, act_code, norm_code, scale,
                 max_kv, with_dq=DqMode.ATOMIC)
    return dq32.to(q.dtype), dk, dv


def launch_bwd_one_pass_phased(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               do: torch.Tensor, scheds, cfg: TileConfig, act_code: int,
                               norm_code: int, scale: float, max_kv: int,
                               hoisted: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Long-KV one-pass backward as three launches over the 'first', 'middle' and 'last' key
    blocks of each sample (``scheds``, in that order; the first built with
    cover_empty_rows): the first stores its partial dQ (the finished one for one-block
    samples), the middle ones add theirs by fp32 atomics, the last adds the sum and stores dQ
    in q's dtype. The stream orders the phases, so the fp32 buffer needs no zeroing and dQ
    no separate cast (two passes over a (total_q, H, d) fp32 buffer saved). hoisted: the last
    phase loads the fp32 partial dQ outside the software pipeline and keeps cfg's stages.
    Not deterministic for samples of more than two key blocks (the middle phase's atomics)."""
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq32 = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    last = DqMode.PHASE_LAST_HOISTED if hoisted else DqMode.PHASE_LAST
    for sched, with_dq in zip(scheds, (DqMode.PHASE_FIRST, DqMode.ATOMIC, last), strict=True):
        # The last phase streams a third tile (the fp32 partial dQ), so it runs with at most
        # 2 stages unless the load is hoisted (spills: gdpa/DESIGN.md).
        stages = min(cfg.num_stages, 2) if with_dq is DqMode.PHASE_LAST else cfg.num_stages
        _launch_dkdv(q, k, v, do, dk, dv, dq, dq32, sched, cfg, act_code, norm_code, scale,
                     max_kv, with_dq, stages)
    return dq, dk, dv
