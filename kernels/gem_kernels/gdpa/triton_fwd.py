"""GDPA forward Triton kernel: persistent grid over a snake-dealt work list.

Each program walks its items (sample, query block, head). Per item: O = act(scale Q K^T) V over
the sample's KV blocks only (fp32 accumulate), then an optional 1/n norm and a masked store.
There is no softmax, so there is no running max, no rescale and no logsumexp.

With short KV the inner loop runs 1-2 times and a classic K/V prefetch never fills, so the
pipeline is over the outer loop: with PREFETCH the next item's query tile is loaded before
the current item's matmuls, and its latency hides behind them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.gdpa.activations import act_fwd, out_scale, scale_args
from gem_kernels.gdpa.triton_common import (
    TileConfig,
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


def fwd_config(max_q: int, max_kv: int, head_dim: int) -> TileConfig:
    """Heuristic tiles: a kv_major config (a sample's whole KV per item) for KV <= 64 rows,
    small row tiles for Q <= 32 rows, else 128-row query tiles through ragged TMA with the
    next query tile prefetched. Why these: gdpa/DESIGN.md."""
    if max_kv <= 64:
        return TileConfig(pow2_at_least(max_kv, 16, 64), 64, num_warps=4, num_stages=3,
                          ctas_per_sm=4, prefetch=False, kv_major=True)
    if max_q <= 32:
        return TileConfig(pow2_at_least(max_q, 16, 32), 64, num_warps=4, num_stages=3,
                          ctas_per_sm=4)
    return TileConfig(128, 64 if head_dim > 64 else 128, num_warps=8, num_stages=3,
                      ctas_per_sm=1, prefetch=True, tma=True)


@triton.jit
def _gdpa_fwd_kernel(Q, K, V, Out, items, prog_ptr,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ot, stride_oh, scale, inv_max_kv,
                     ACT: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr,
                     PREFETCH: tl.constexpr, PREC: tl.constexpr, FOLD: tl.constexpr,
                     CSCALE: tl.constexpr):
    start, end = program_items(prog_ptr)
    # Item metadata runs two items ahead, the query tile one item ahead.
    blk, h, r0, rlen, c0, clen = load_meta(items, start)
    nblk, nh, nr0, nrlen, nc0, nclen = load_meta(items, tl.minimum(start + 1, end - 1))
    q = load_rows(Q, r0, rlen, blk, h, stride_qt, stride_qh, BM, D)
    offs_d = tl.arange(0, D)
    for it in range(start, end):
        mblk, mh, mr0, mrlen, mc0, mclen = load_meta(items, tl.minimum(it + 2, end - 1))
        if PREFETCH:
            q_next = load_rows(Q, nr0, nrlen, nblk, nh, stride_qt, stride_qh, BM, D)
        acc = tl.zeros((BM, D), dtype=tl.float32)
        k_base = K + h * stride_kh + offs_d[None, :]
        v_base = V + h * stride_vh + offs_d[None, :]
        for n0 in tl.range(0, clen, BN, num_stages=STAGES):
            crow, cmask = tile_rows(c0, n0, clen, BN)
            k = tl.load(k_base + crow * stride_kt, mask=cmask, other=0.0)
            v = tl.load(v_base + crow * stride_vt, mask=cmask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            # K and V rows past the sample are 0, so act(0) = 0 times v = 0: no mask needed.
            p = act_fwd(s, scale, ACT, FOLD, CSCALE)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        acc = acc * (norm_factor(clen, inv_max_kv, NORM) * out_scale(scale, FOLD))
        store_rows(Out, acc, r0, rlen, blk, h, stride_ot, stride_oh, BM, D)
        if not PREFETCH:
            q_next = load_rows(Q, nr0, nrlen, nblk, nh, stride_qt, stride_qh, BM, D)
        q = q_next
        blk, h, r0, rlen, c0, clen = nblk, nh, nr0, nrlen, nc0, nclen
        nblk, nh, nr0, nrlen, nc0, nclen = mblk, mh, mr0, mrlen, mc0, mclen


@triton.jit
def _gdpa_fwd_kv_major_kernel(Q, K, V, Out, items, prog_ptr,
                              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                              stride_vh, stride_ot, stride_oh, scale, inv_max_kv,
                              ACT: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr,
                              BN: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr,
                              PREC: tl.constexpr, FOLD: tl.constexpr, CSCALE: tl.constexpr):
    """Short KV: each item holds one sample's whole KV (<= BN rows) for one head and streams
    the sample's query tiles through the software pipeline, so Q crosses HBM once and K, V
    once per item, and the long inner loop keeps loads in flight."""
    start, end = program_items(prog_ptr)
    offs_d = tl.arange(0, D)
    for it in range(start, end):
        blk, h, r0, rlen, c0, clen = load_meta(items, it)
        # K and V rows past the sample are 0: act(0) = 0, so they add nothing.
        k = load_rows(K, r0, rlen, blk, h, stride_kt, stride_kh, BN, D)
        v = load_rows(V, r0, rlen, blk, h, stride_vt, stride_vh, BN, D)
        c = norm_factor(rlen, inv_max_kv, NORM) * out_scale(scale, FOLD)
        q_base = Q + h * stride_qh + offs_d[None, :]
        o_base = Out + h * stride_oh + offs_d[None, :]
        for m0 in tl.range(0, clen, BM, num_stages=STAGES):
            crow, cmask = tile_rows(c0, m0, clen, BM)
            q = tl.load(q_base + crow * stride_qt, mask=cmask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            p = act_fwd(s, scale, ACT, FOLD, CSCALE)
            o = tl.dot(p.to(v.dtype), v, input_precision=PREC) * c
            tl.store(o_base + crow * stride_ot, o.to(Out.dtype.element_ty), mask=cmask)


@triton.jit
def _gdpa_fwd_tma_kernel(q_desc, k_desc, v_desc, o_desc, Q, stride_qt, stride_qh, items,
                         prog_ptr, scale, inv_max_kv,
                         ACT: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr,
                         PREC: tl.constexpr, FOLD: tl.constexpr, CSCALE: tl.constexpr,
                         FLATTEN: tl.constexpr, WS: tl.constexpr, PREFETCH: tl.constexpr):
    """The query-block forward through ragged TMA descriptors over (rows, H * D) views: a
    tile of a sample's rows reads rows past the sample as 0 (so act(0) V = 0 needs no mask)
    and its store skips them. PREFETCH loads the next item's query tile with ordinary
    (masked) loads before the current item's KV loop, as the pointer kernel does: a TMA load
    outside the pipelined loop would wait at once."""
    start, end = program_items(prog_ptr)
    if PREFETCH:
        blk, h, r0, rlen, c0, clen = load_meta(items, start)
        q = load_rows(Q, r0, rlen, blk, h, stride_qt, stride_qh, BM, D)
    for it in tl.range(start, end, flatten=FLATTEN):
        if PREFETCH:
            nblk, nh, nr0, nrlen, nc0, nclen = load_meta(items, tl.minimum(it + 1, end - 1))
            q_next = load_rows(Q, nr0, nrlen, nblk, nh, stride_qt, stride_qh, BM, D)
        else:
            blk, h, r0, rlen, c0, clen = load_meta(items, it)
            q = load_ragged_rows(q_desc, r0, rlen, blk * BM, h * D, BM, D)
        acc = tl.zeros((BM, D), dtype=tl.float32)
        for n0 in tl.range(0, clen, BN, num_stages=STAGES, warp_specialize=WS):
            k = load_ragged_rows(k_desc, c0, clen, n0, h * D, BN, D)
            v = load_ragged_rows(v_desc, c0, clen, n0, h * D, BN, D)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            p = act_fwd(s, scale, ACT, FOLD, CSCALE)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        acc = acc * (norm_factor(clen, inv_max_kv, NORM) * out_scale(scale, FOLD))
        store_ragged_rows(o_desc, r0, rlen, blk * BM, h * D, acc.to(o_desc.dtype), BM, D)
        if PREFETCH:
            q = q_next
            blk, h, r0, rlen, c0, clen = nblk, nh, nr0, nrlen, nc0, nclen


def launch_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sched, cfg: TileConfig,
               act_code: int, norm_code: int, scale: float, max_kv: int) -> torch.Tensor:
    """Output (total_q, H, d); every row is written by exactly one item. A kv_major config
    needs a schedule over (KV, Q) built with cover_empty_rows (see op.schedule_for)."""
    out = torch.empty_like(q)
    if sched.num_items == 0:
        return out
    fold, cscale = scale_args(act_code, scale, q.dtype, cfg.scale_mode)
    if cfg.kv_major:
        _gdpa_fwd_kv_major_kernel[(sched.num_programs,)](
            q, k, v, out, sched.items, sched.prog_ptr,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), scale, 1.0 / max(max_kv, 1),
            ACT=act_code, NORM=norm_code, D=q.shape[-1], BN=cfg.block_rows,
            BM=cfg.block_cols, STAGES=cfg.num_stages, PREC=dot_precision(q),
            FOLD=fold, CSCALE=cscale, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        return out
    if cfg.tma and tma_ok(q, k, v, out):
        bm, bn, d = cfg.block_rows, cfg.block_cols, q.shape[-1]
        _gdpa_fwd_tma_kernel[(sched.num_programs,)](
            ragged_desc(q, bm), ragged_desc(k, bn), ragged_desc(v, bn),
            ragged_desc(out, bm), q, q.stride(0), q.stride(1), sched.items, sched.prog_ptr,
            scale, 1.0 / max(max_kv, 1),
            ACT=act_code, NORM=norm_code, D=d, BM=bm, BN=bn, STAGES=cfg.num_stages,
            PREC=dot_precision(q), FOLD=fold, CSCALE=cscale, FLATTEN=cfg.flatten,
            WS=cfg.warp_specialize, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        return out
    _gdpa_fwd_kernel[(sched.num_programs,)](
        q, k, v, out, sched.items, sched.prog_ptr,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), scale, 1.0 / max(max_kv, 1),
        ACT=act_code, NORM=norm_code, D=q.shape[-1], BM=cfg.block_rows, BN=cfg.block_cols,
        STAGES=cfg.num_stages, PREFETCH=cfg.prefetch, PREC=dot_precision(q),
        FOLD=fold, CSCALE=cscale, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
