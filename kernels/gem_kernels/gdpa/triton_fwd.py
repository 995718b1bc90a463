"""GDPA forward Triton kernel: persistent grid over a snake-dealt work list.

Each program walks its items (sample, query block, head). Per item: O = act(scale Q K^T) V over
the sample's KV blocks only (fp32 accumulate), then an optional 1/n norm and a masked store.
There is no softmax, so there is no running max, no rescale and no logsumexp.

With short KV the inner loop runs 1-2 times and a classic K/V prefetch never fills, so the
pipeline is over the outer loop: with PREFETCH the next item's query tile is loaded before
the current item's matmuls, and its latency hides behind them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.ragged_tma import create_ragged_descriptor

from gem_kernels.gdpa.activations import act_fwd, out_scale, scale_args


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
    # Forward over query blocks only: load Q, K, V and store O through ragged TMA
    # descriptors (rows past a sample read as 0 and are never written, in hardware; no
    # address or mask arithmetic per element). Needs 16-byte aligned rows.
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


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def fwd_config(max_q: int, max_kv: int, head_dim: int) -> TileConfig:
    """Heuristic tiles: small column tiles for short KV, small row tiles for short Q."""
    # Measured on the H200 (docs/bench/gdpa.json): with 4 programs per SM hiding latency,
    # short-KV tiles ran faster without the query prefetch (fewer registers).
    if max_kv <= 64:
        # KV-major: a sample's whole KV per item, its query tiles streamed with 3 stages.
        # H200 (cross, 16 KV, d=128): 0.073 ms = 72% of HBM vs 0.077 for query-block items.
        return TileConfig(_pow2_at_least(max_kv, 16, 64), 64, num_warps=4, num_stages=3,
                          ctas_per_sm=4, prefetch=False, kv_major=True)
    if max_q <= 32:
        return TileConfig(_pow2_at_least(max_q, 16, 32), 64, num_warps=4, num_stages=3,
                          ctas_per_sm=4)
    # H200 (self, log-normal mean 470, gelu_tanh): K, V by ragged TMA with the next query
    # tile prefetched 0.466 ms; TMA without the prefetch 0.525; pointer loads 0.528.
    return TileConfig(128, 64 if head_dim > 64 else 128, num_warps=8, num_stages=3,
                      ctas_per_sm=1, prefetch=True, tma=True)


def _prec(x: torch.Tensor) -> str:
    """fp32 inputs get exact fp32 dots (tests, fp32 training); 16-bit ones ignore it."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


@triton.jit
def load_meta(items, it):
    """(block, head, row_start, row_len, col_start, col_len) of item ``it``: independent
    scalar loads, so prefetching them never waits on another load."""
    base = items + it * 6
    return (tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3),
            tl.load(base + 4), tl.load(base + 5))


@triton.jit
def load_rows(ptr, start, length, blk, h, stride_t, stride_h, BLOCK: tl.constexpr,
              D: tl.constexpr):
    """(BLOCK, D) tile of rows blk*BLOCK.. of one sample and head; rows past the end are 0."""
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    offs = (start + rows).to(tl.int64)[:, None] * stride_t + h * stride_h \
        + tl.arange(0, D)[None, :]
    return tl.load(ptr + offs, mask=(rows < length)[:, None], other=0.0)


@triton.jit
def store_rows(ptr, x, start, length, blk, h, stride_t, stride_h, BLOCK: tl.constexpr,
               D: tl.constexpr):
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    offs = (start + rows).to(tl.int64)[:, None] * stride_t + h * stride_h \
        + tl.arange(0, D)[None, :]
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=(rows < length)[:, None])


@triton.jit
def norm_factor(col_len, inv_max_kv, NORM: tl.constexpr):
    """1/n for norm 'kv_len' (0 rows -> 0, the sum is 0 anyway), 1/max_kv, or 1."""
    if NORM == 1:
        return 1.0 / tl.maximum(col_len, 1).to(tl.float32)
    elif NORM == 2:
        return inv_max_kv
    else:
        return 1.0


@triton.jit
def _gdpa_fwd_kernel(Q, K, V, Out, items, prog_ptr,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ot, stride_oh, scale, inv_max_kv,
                     ACT: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr,
                     PREFETCH: tl.constexpr, PREC: tl.constexpr, FOLD: tl.constexpr,
                     CSCALE: tl.constexpr):
    pid = tl.program_id(0)
    start = tl.load(prog_ptr + pid)
    end = tl.load(prog_ptr + pid + 1)
    # Item metadata runs two items ahead, the query tile one item ahead.
    blk, h, r0, rlen, c0, clen = load_meta(items, start)
    nblk, nh, nr0, nrlen, nc0, nclen = load_meta(items, tl.minimum(start + 1, end - 1))
    q = load_rows(Q, r0, rlen, blk, h, stride_qt, stride_qh, BM, D)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    for it in range(start, end):
        mblk, mh, mr0, mrlen, mc0, mclen = load_meta(items, tl.minimum(it + 2, end - 1))
        if PREFETCH:
            q_next = load_rows(Q, nr0, nrlen, nblk, nh, stride_qt, stride_qh, BM, D)
        acc = tl.zeros((BM, D), dtype=tl.float32)
        k_base = K + h * stride_kh + offs_d[None, :]
        v_base = V + h * stride_vh + offs_d[None, :]
        for n0 in tl.range(0, clen, BN, num_stages=STAGES):
            cols = n0 + offs_n
            cmask = (cols < clen)[:, None]
            crow = (c0 + cols).to(tl.int64)[:, None]
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
    pid = tl.program_id(0)
    start = tl.load(prog_ptr + pid)
    end = tl.load(prog_ptr + pid + 1)
    offs_m = tl.arange(0, BM)
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
            cols = m0 + offs_m
            cmask = (cols < clen)[:, None]
            crow = (c0 + cols).to(tl.int64)[:, None]
            q = tl.load(q_base + crow * stride_qt, mask=cmask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            p = act_fwd(s, scale, ACT, FOLD, CSCALE)
            o = tl.dot(p.to(v.dtype), v, input_precision=PREC) * c
            tl.store(o_base + crow * stride_ot, o.to(Out.dtype.element_ty), mask=cmask)


_BILLION = tl.constexpr(0x40000000)  # the ragged descriptor's row extent (2**30)


@triton.jit
def load_ragged_rows(desc, start, length, row, col, BLOCK: tl.constexpr, D: tl.constexpr):
    """(BLOCK, D) tile of rows start+row.. of a sample of ``length`` rows through a ragged
    descriptor (triton.tools.ragged_tma's index scheme): rows past the sample read as 0."""
    x = desc.load([_BILLION, start + length, _BILLION - length + row, col])
    return tl.reshape(x, [BLOCK, D])


@triton.jit
def store_ragged_rows(desc, start, length, row, col, x, BLOCK: tl.constexpr,
                      D: tl.constexpr):
    """Stores a (BLOCK, D) tile at rows start+row..; rows past the sample are skipped."""
    desc.store([_BILLION, start + length, _BILLION - length + row, col],
               tl.reshape(x, [1, 1, BLOCK, D]))


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
    pid = tl.program_id(0)
    start = tl.load(prog_ptr + pid)
    end = tl.load(prog_ptr + pid + 1)
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


def tma_ok(*tensors: torch.Tensor) -> bool:
    """The TMA kernels take 16-bit tensors (their fp32 tiles would not fit in shared memory)
    with 16-byte aligned bases and row strides (contiguous (rows, H, d) tensors); the
    launchers fall back to the pointer kernels otherwise."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.element_size() == 2
               and (t.shape[1] * t.shape[2] * t.element_size()) % 16 == 0 for t in tensors)


def _ragged_desc(x: torch.Tensor, rows: int) -> object:
    return create_ragged_descriptor(x.view(x.shape[0], -1), [rows, x.shape[2]])


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
            BM=cfg.block_cols, STAGES=cfg.num_stages, PREC=_prec(q),
            FOLD=fold, CSCALE=cscale, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        return out
    if cfg.tma and tma_ok(q, k, v, out):
        bm, bn, d = cfg.block_rows, cfg.block_cols, q.shape[-1]
        _gdpa_fwd_tma_kernel[(sched.num_programs,)](
            _ragged_desc(q, bm), _ragged_desc(k, bn), _ragged_desc(v, bn),
            _ragged_desc(out, bm), q, q.stride(0), q.stride(1), sched.items, sched.prog_ptr,
            scale, 1.0 / max(max_kv, 1),
            ACT=act_code, NORM=norm_code, D=d, BM=bm, BN=bn, STAGES=cfg.num_stages,
            PREC=_prec(q), FOLD=fold, CSCALE=cscale, FLATTEN=cfg.flatten,
            WS=cfg.warp_specialize, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        return out
    _gdpa_fwd_kernel[(sched.num_programs,)](
        q, k, v, out, sched.items, sched.prog_ptr,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), scale, 1.0 / max(max_kv, 1),
        ACT=act_code, NORM=norm_code, D=q.shape[-1], BM=cfg.block_rows, BN=cfg.block_cols,
        STAGES=cfg.num_stages, PREFETCH=cfg.prefetch, PREC=_prec(q),
        FOLD=fold, CSCALE=cscale, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
