"""Triton kernels for block attention: a one-program block plan, the forward and the backward.

Each (block, head) pair is an independent BLOCK x BLOCK problem whose q, k, v fit in registers,
so a tile is read once, its scores and exact softmax are computed in one pass (no online
rescaling, no logsumexp in HBM) and its output is written once. The backward recomputes the
softmax from q and k and gets the rowsum(dO * O) term as rowsum(P * dP), so it reads neither O
nor any saved statistic. Both kernels run a persistent grid over the (block, head) work items,
head fastest, in one of two orders: a contiguous chunk per program (a program walks the heads of
a block over the same rows), or ``STRIDE``: program p takes items p, p + P, p + 2P, ... (P
programs). Items cost about the same, so a run takes as many rounds as its busiest program has
items; with chunks, ceil(items / P) items per program leave whole programs idle (3776 items on
264 programs: 251 programs of 15, 12 idle), while striding keeps every program busy until the
last round, which only n mod P programs run (each then gets a larger share of the bandwidth).

RoPE (rotate-half convention, see rope.py) is applied to the q and k tiles right after the load,
in the input dtype (tables stored in it, as eager RoPE in bf16 models does; it keeps the tiles
small and the table traffic low); the backward applies the inverse rotation to the
fp32 dq and dk accumulators just before the store. q and k are handled as two halves of
head_dim/2 columns each, so the rotation is elementwise and the score is the sum of two
half-width dots. With num_stages >= 2 Triton's pipeliner copies the tiles into shared memory
asynchronously (cp.async); how far ahead depends on how the plan row is read (_plan_entry).

Block-relative RoPE (``REL``): a RoPE score depends only on the distance between query and key,
R(p)q . R(p')k = q . R(p' - p)k, and both always lie in the same block, so rotating by the slot
within the block (p - block start) gives the same scores as rotating by the position in the
sequence, up to rounding (smaller angles round less). Then one (BLOCK, D/2) table serves every
block: it stays in L1 (or, with ``HOIST``, in registers for the whole persistent loop) instead
of one table tile per work item streaming through L2. Used for RopeConfig; RopeTables
(arbitrary user tables, which need not be linear in the position) keep the absolute path.
The backward's inverse rotation uses the same angles as its forward, so gradients are exact
for the function the forward computed.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["B"])
def plan_kernel(OFF, PLAN, NBLK, B, BLOCK: tl.constexpr, BB: tl.constexpr):
    """One program: per block (start token, length, position of its first token, 0); four
    int32 per row so that a row is one aligned 16-byte load (see _plan_entry)."""
    i = tl.arange(0, BB)
    m = i < B
    s = tl.load(OFF + i, mask=m, other=0).to(tl.int32)
    e = tl.load(OFF + i + 1, mask=m, other=0).to(tl.int32)
    n = e - s
    nb = (n + BLOCK - 1) // BLOCK
    first = tl.cumsum(nb, 0) - nb
    tl.store(NBLK, tl.sum(nb, 0))
    for j in range(0, tl.max(nb, 0)):
        mj = m & (j < nb)
        blk = first + j
        tl.store(PLAN + blk * 4, s + j * BLOCK, mask=mj)
        tl.store(PLAN + blk * 4 + 1, tl.minimum(n - j * BLOCK, BLOCK), mask=mj)
        tl.store(PLAN + blk * 4 + 2, tl.zeros_like(s) + j * BLOCK, mask=mj)
        tl.store(PLAN + blk * 4 + 3, tl.zeros_like(s), mask=mj)


@triton.jit
def _plan_entry(PLAN, blk, VEC_PLAN: tl.constexpr):
    """(start token, length, first position) of block blk.

    How the row is read steers Triton's software pipeliner (sm_90). Read as one 4-element
    vector (VEC_PLAN), the row is prefetched with the tiles, and num_stages=3 keeps the q, k, v
    tiles of the next two items in flight while one computes (128 KiB of shared memory at
    head_dim 128: one program per SM). Read as scalars, the next item's tiles are issued once
    the current item is computed and are waited for at the top of the next iteration (82 KiB:
    two programs per SM, which overlap each other's loads). A launch setting
    (autograd.TUNE_SPACE); block_attention/DESIGN.md compares the two.
    """
    if VEC_PLAN:
        i = tl.arange(0, 4)
        e = tl.load(PLAN + blk * 4 + i)
        return (tl.sum(tl.where(i == 0, e, 0), 0), tl.sum(tl.where(i == 1, e, 0), 0),
                tl.sum(tl.where(i == 2, e, 0), 0))
    return tl.load(PLAN + blk * 4), tl.load(PLAN + blk * 4 + 1), tl.load(PLAN + blk * 4 + 2)


@triton.jit
def _rotate(x1, x2, c, s):
    """RoPE on the two halves, fp32 in, fp32 out."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _rope_tile(COS, SIN, pos0, rows, cols, rmask, HALF: tl.constexpr, REL: tl.constexpr):
    """cos/sin (BLOCK, D/2) for one block: rows 0..BLOCK-1 of the table when block-relative,
    else the rows of the block's positions in the sequence (pos0: its first position)."""
    if REL:
        t = rows[:, None] * HALF + cols[None, :]
        c = tl.load(COS + t)
        s = tl.load(SIN + t)
    else:
        t = (pos0 + rows)[:, None] * HALF + cols[None, :]
        c = tl.load(COS + t, mask=rmask[:, None], other=0.0, eviction_policy="evict_last")
        s = tl.load(SIN + t, mask=rmask[:, None], other=0.0, eviction_policy="evict_last")
    return c, s


@triton.jit
def _load_tile_halves(X, row_off, h_off, cols, rmask, HALF: tl.constexpr):
    p = X + row_off[:, None] + h_off + cols[None, :]
    x1 = tl.load(p, mask=rmask[:, None], other=0.0)
    x2 = tl.load(p + HALF, mask=rmask[:, None], other=0.0)
    return x1, x2


@triton.jit
def _item_range(NBLK, H, STRIDE: tl.constexpr):
    """(first, end, step) of this program's work items; see the module docstring."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_items = tl.load(NBLK) * H
    if STRIDE:
        return pid, n_items, nprog
    chunk = tl.cdiv(n_items, nprog)
    first = pid * chunk
    return first, tl.minimum(first + chunk, n_items), 1


@triton.jit
def _scores_to_probs(q1, q2, k1, k2, rows, length, qk_scale, CAUSAL: tl.constexpr):
    """Exact softmax of one tile's scores (fp32), padded keys (and future keys) masked."""
    s = tl.dot(q1, tl.trans(k1))
    s = tl.dot(q2, tl.trans(k2), s)
    s = s * qk_scale
    keep = (rows < length)[None, :]
    if CAUSAL:
        keep = keep & (rows[None, :] <= rows[:, None])
    s = tl.where(keep, s, float("-inf"))
    m = tl.max(s, 1)
    p = tl.exp2(s - m[:, None])
    return p / tl.sum(p, 1)[:, None]


@triton.jit
def fwd_kernel(Q, K, V, Out, PLAN, NBLK, COS, SIN,
               sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
               H, qk_scale,
               BLOCK: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
               CAUSAL: tl.constexpr, CTAS: tl.constexpr, REL: tl.constexpr = False,
               HOIST: tl.constexpr = False, SPLIT_PV: tl.constexpr = False,
               STRIDE: tl.constexpr = False, VEC_PLAN: tl.constexpr = False):
    HALF: tl.constexpr = D // 2
    first, end, step = _item_range(NBLK, H, STRIDE)
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, HALF)
    dcols = tl.arange(0, D)
    dtype = Q.dtype.element_ty
    if ROPE and REL and HOIST:  # one table for every block: load it once per program
        c0 = tl.load(COS + rows[:, None] * HALF + cols[None, :])
        s0 = tl.load(SIN + rows[:, None] * HALF + cols[None, :])
    for w in range(first, end, step):
        blk = w // H
        h = w % H
        start, length, pos0 = _plan_entry(PLAN, blk, VEC_PLAN)
        tok = (start + rows).to(tl.int64)
        rmask = rows < length
        q1, q2 = _load_tile_halves(Q, tok * sq_t, h * sq_h, cols, rmask, HALF)
        k1, k2 = _load_tile_halves(K, tok * sk_t, h * sk_h, cols, rmask, HALF)
        if not SPLIT_PV:
            v = tl.load(V + (tok * sv_t)[:, None] + h * sv_h + dcols[None, :],
                        mask=rmask[:, None], other=0.0)
        if ROPE:
            if REL and HOIST:
                c, sn = c0, s0
            else:
                c, sn = _rope_tile(COS, SIN, pos0, rows, cols, rmask, HALF, REL)
            q1, q2 = _rotate(q1, q2, c, sn)
            k1, k2 = _rotate(k1, k2, c, sn)
        p = _scores_to_probs(q1, q2, k1, k2, rows, length, qk_scale, CAUSAL).to(dtype)
        if SPLIT_PV:
            # P V in two column halves, each stored at once: half the output accumulator live
            v1, v2 = _load_tile_halves(V, tok * sv_t, h * sv_h, cols, rmask, HALF)
            o_ptr = Out + (tok * so_t)[:, None] + h * so_h + cols[None, :]
            tl.store(o_ptr, tl.dot(p, v1).to(dtype), mask=rmask[:, None])
            tl.store(o_ptr + HALF, tl.dot(p, v2).to(dtype), mask=rmask[:, None])
        else:
            o = tl.dot(p, v)
            tl.store(Out + (tok * so_t)[:, None] + h * so_h + dcols[None, :], o.to(dtype),
                     mask=rmask[:, None])


@triton.jit
def bwd_kernel(Q, K, V, DO, DQ, DK, DV, PLAN, NBLK, COS, SIN,
               sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sdo_t, sdo_h, sg_t, sg_h,
               H, qk_scale, sm_scale,
               BLOCK: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
               CAUSAL: tl.constexpr, CTAS: tl.constexpr, REL: tl.constexpr = False,
               STRIDE: tl.constexpr = False, VEC_PLAN: tl.constexpr = False):
    """dq, dk, dv share one layout (sg_t, sg_h); dq and dk leave rotated back by RoPE^T."""
    HALF: tl.constexpr = D // 2
    first, end, step = _item_range(NBLK, H, STRIDE)
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, HALF)
    dcols = tl.arange(0, D)
    dtype = Q.dtype.element_ty
    for w in range(first, end, step):
        blk = w // H
        h = w % H
        start, length, pos0 = _plan_entry(PLAN, blk, VEC_PLAN)
        tok = (start + rows).to(tl.int64)
        rmask = rows < length
        q1, q2 = _load_tile_halves(Q, tok * sq_t, h * sq_h, cols, rmask, HALF)
        k1, k2 = _load_tile_halves(K, tok * sk_t, h * sk_h, cols, rmask, HALF)
        v = tl.load(V + (tok * sv_t)[:, None] + h * sv_h + dcols[None, :],
                    mask=rmask[:, None], other=0.0)
        do = tl.load(DO + (tok * sdo_t)[:, None] + h * sdo_h + dcols[None, :],
                     mask=rmask[:, None], other=0.0)
        if ROPE:
            c, sn = _rope_tile(COS, SIN, pos0, rows, cols, rmask, HALF, REL)
            q1, q2 = _rotate(q1, q2, c, sn)
            k1, k2 = _rotate(k1, k2, c, sn)
        p = _scores_to_probs(q1, q2, k1, k2, rows, length, qk_scale, CAUSAL)
        # Each gradient is stored as soon as it is complete, so that its accumulator dies
        # before the next one is born (the tiles stay within two programs' registers per SM).
        g = (tok * sg_t)[:, None] + h * sg_h
        gm = rmask[:, None]
        dv = tl.dot(tl.trans(p.to(dtype)), do)
        tl.store(DV + g + dcols[None, :], dv.to(dtype), mask=gm)
        dp = tl.dot(do, tl.trans(v))
        # rowsum(dO * O) == rowsum(P * dP): no read of O needed.
        delta = tl.sum(p * dp, 1)
        ds = (p * (dp - delta[:, None]) * sm_scale).to(dtype)
        dq1 = tl.dot(ds, k1)
        dq2 = tl.dot(ds, k2)
        if ROPE:
            # Inverse rotation (RoPE^T, angle -> -angle) with the same angles as the forward;
            # tables re-read (L1/L2) rather than kept live through the whole tile.
            cf, sf = _rope_tile(COS, SIN, pos0, rows, cols, rmask, HALF, REL)
            cf, sf = cf.to(tl.float32), sf.to(tl.float32)
            dq1, dq2 = _rotate(dq1, dq2, cf, -sf)
        tl.store(DQ + g + cols[None, :], dq1.to(dtype), mask=gm)
        tl.store(DQ + g + HALF + cols[None, :], dq2.to(dtype), mask=gm)
        dst = tl.trans(ds)
        dk1 = tl.dot(dst, q1)
        dk2 = tl.dot(dst, q2)
        if ROPE:
            dk1, dk2 = _rotate(dk1, dk2, cf, -sf)
        tl.store(DK + g + cols[None, :], dk1.to(dtype), mask=gm)
        tl.store(DK + g + HALF + cols[None, :], dk2.to(dtype), mask=gm)
