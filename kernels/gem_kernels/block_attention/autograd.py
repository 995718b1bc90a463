"""Autograd wiring for the Triton block attention kernels: block plan, launch settings, grid."""

from __future__ import annotations

import functools
import os
import weakref

import torch
import triton

from gem_kernels.block_attention import triton_kernels as tk
from gem_kernels.block_attention.rope import Rope, RopeConfig, rope_tables_for

_PLAN_MAX_BATCH = 16384  # the plan is one program over the whole batch up to this size
_INTERPRET_META = {"CTAS": 1, "num_warps": 4}

# Launch settings (CTAS: persistent programs per SM). num_stages >= 2 pipelines the persistent
# loop. Registers (ptxas, sm_90, d=128, RoPE, 4 warps): 255 per thread in both kernels, so two
# programs fit on an SM; the forward with RoPE spills unless the block-relative table is
# hoisted (HOIST) and P V is split in column halves (SPLIT_PV). 8-warp forwards ran 1.4-1.9x
# slower on the H200. Measured best there (docs/bench/block_attention.json, bench --sweep).
DEFAULT_META = {
    64: ({"CTAS": 4, "num_warps": 4, "num_stages": 2, "HOIST": True, "SPLIT_PV": True},
         {"CTAS": 2, "num_warps": 4, "num_stages": 2}),
    128: ({"CTAS": 2, "num_warps": 4, "num_stages": 3, "HOIST": True, "SPLIT_PV": True},
          {"CTAS": 2, "num_warps": 4, "num_stages": 1}),
}
TUNE_SPACE = {
    "fwd": [{"CTAS": c, "num_warps": w, "num_stages": s, "HOIST": hoist, "SPLIT_PV": split}
            for c, w, s in ((2, 4, 3), (2, 4, 2), (4, 4, 2), (2, 4, 1))
            for hoist in (False, True) for split in (True, False)],
    "bwd": [{"CTAS": c, "num_warps": w, "num_stages": s}
            for c, w, s in ((2, 4, 1), (1, 4, 2), (2, 4, 2), (1, 8, 2), (2, 8, 1), (1, 8, 1),
                            (3, 4, 1))],
}
TUNED: dict[tuple, dict] = {}
_AUTOTUNE = False


def use_autotune(enabled: bool) -> None:
    """Time TUNE_SPACE once per (direction, head_dim, heads, rope, causal, dtype) on first use
    and keep the fastest; off by default so that tests do not pay for the tuning compiles."""
    global _AUTOTUNE
    _AUTOTUNE = bool(enabled)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_supported(q: torch.Tensor, block: int) -> bool:
    """The kernels cover fp16/bf16, head_dim 64/128 and block 64 (other shapes: reference)."""
    return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)
            and block == 64)


def build_plan(offsets: torch.Tensor, total_tokens: int, block: int
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(max_blocks, 3) int32 [start token, length, first position] per block, the real block
    count as a 1-element device tensor, and max_blocks, an upper bound known without a sync."""
    batch = offsets.numel() - 1
    if batch > _PLAN_MAX_BATCH:
        raise ValueError(f"block_attention supports batches up to {_PLAN_MAX_BATCH} sequences "
                         f"per call; got {batch}")
    max_blocks = total_tokens // block + batch
    plan = torch.empty(max(max_blocks, 1), 3, dtype=torch.int32, device=offsets.device)
    nblk = torch.empty(1, dtype=torch.int32, device=offsets.device)
    bb = max(triton.next_power_of_2(max(batch, 1)), 16)
    tk.plan_kernel[(1,)](offsets, plan, nblk, batch, BLOCK=block, BB=bb,
                         num_warps=4 if bb <= 2048 else 8)
    return plan, nblk, max_blocks


_PLANS: dict[tuple, tuple] = {}


def cached_plan(offsets: torch.Tensor, total_tokens: int, block: int
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """build_plan, reused while the same offsets tensor is passed unmodified (every layer of a
    model and the backward share one batch's offsets). Not cached during graph capture."""
    key = (id(offsets), total_tokens, block)
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is offsets and hit[1] == offsets._version:
        return hit[2]
    plan = build_plan(offsets, total_tokens, block)
    if offsets.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        if len(_PLANS) >= 32:
            _PLANS.clear()
        _PLANS[key] = (weakref.ref(offsets), offsets._version, plan)
    return plan


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(max_items: int, device: torch.device):
    if _interpreting():
        return lambda meta: (max(min(max_items, 4), 1),)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return lambda meta: (max(min(max_items, sms * meta["CTAS"]), 1),)


def _tune(kernel, grid, args: tuple, consts: dict, space: list[dict]) -> dict:  # noqa: ANN001
    from triton.testing import do_bench

    if not (consts["ROPE"] and consts["REL"]):  # HOIST only matters for the one shared table
        space = [m for m in space if not m.get("HOIST")]
    best, best_ms = None, float("inf")
    for meta in space:
        try:
            kernel[grid](*args, **consts, **meta)
            ms = do_bench(lambda meta=meta: kernel[grid](*args, **consts, **meta),
                          warmup=5, rep=25, return_mode="median")
        except triton.runtime.errors.OutOfResources:
            continue
        if ms < best_ms:
            best, best_ms = meta, ms
    if best is None:
        raise RuntimeError("no launch setting of the block attention kernel fits this GPU")
    return best


def _launch(which: str, kernel, args: tuple, consts: dict, grid, heads: int,  # noqa: ANN001
            dtype: torch.dtype, autotune: bool) -> None:
    if _interpreting():
        extra = {"HOIST": True, "SPLIT_PV": True} if which == "fwd" else {}  # default path
        kernel[grid](*args, **consts, **_INTERPRET_META, **extra)
        return
    d = consts["D"]
    meta = DEFAULT_META[d][0 if which == "fwd" else 1]
    if autotune:
        key = (which, d, heads, consts["ROPE"], consts["REL"], consts["CAUSAL"], dtype)
        if key not in TUNED:
            TUNED[key] = _tune(kernel, grid, args, consts, TUNE_SPACE[which])
        meta = TUNED[key]
    kernel[grid](*args, **consts, **meta)


def _strides(x: torch.Tensor) -> tuple[int, int]:
    return x.stride(0), x.stride(1)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, block, cos, sin, rel, scale, causal):  # noqa: ANN001
        total, heads, dim = q.shape
        plan, nblk, max_blocks = cached_plan(offsets, total, block)
        o = torch.empty(total, heads, dim, dtype=q.dtype, device=q.device)
        rope = cos is not None
        args = (q, k, v, o, plan, nblk, cos if rope else q, sin if rope else q,
                *_strides(q), *_strides(k), *_strides(v), *_strides(o), heads,
                scale * tk.LOG2E)
        consts = {"BLOCK": block, "D": dim, "ROPE": rope, "CAUSAL": causal, "REL": rel}
        _launch("fwd", tk.fwd_kernel, args, consts, _grid(max_blocks * heads, q.device), heads,
                q.dtype, _AUTOTUNE)
        ctx.save_for_backward(q, k, v, plan, nblk, cos, sin)
        ctx.meta = (block, rel, scale, causal, max_blocks, _AUTOTUNE)
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001
        q, k, v, plan, nblk, cos, sin = ctx.saved_tensors
        block, rel, scale, causal, max_blocks, autotune = ctx.meta
        total, heads, dim = q.shape
        if do.stride(-1) != 1:
            do = do.contiguous()
        grads = torch.empty(3, total, heads, dim, dtype=q.dtype, device=q.device)
        dq, dk, dv = grads[0], grads[1], grads[2]
        rope = cos is not None
        args = (q, k, v, do, dq, dk, dv, plan, nblk, cos if rope else q, sin if rope else q,
                *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq), heads,
                scale * tk.LOG2E, scale)
        consts = {"BLOCK": block, "D": dim, "ROPE": rope, "CAUSAL": causal, "REL": rel}
        _launch("bwd", tk.bwd_kernel, args, consts, _grid(max_blocks * heads, q.device), heads,
                q.dtype, autotune)
        return dq, dk, dv, None, None, None, None, None, None, None


def block_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           offsets: torch.Tensor, *, block: int, rope: Rope | None,
                           scale: float, causal: bool) -> torch.Tensor:
    """Triton block attention; q, k, v may be strided views (last dim contiguous)."""
    total, _, dim = q.shape
    if total == 0:
        return torch.empty_like(q)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if offsets.device != q.device or offsets.dtype != torch.int64 or not offsets.is_contiguous():
        offsets = offsets.to(device=q.device, dtype=torch.int64).contiguous()
    cos = sin = None
    # RopeConfig: block-relative angles, one (block, d/2) table for every block (see
    # triton_kernels). RopeTables: the user's rows at each token's position in its sequence.
    rel = isinstance(rope, RopeConfig)
    if rope is not None:
        tables = rope_tables_for(rope, block if rel else total, dim, q.device, q.dtype)
        cos, sin = tables.cos, tables.sin
    return _BlockAttention.apply(q, k, v, offsets, block, cos, sin, rel, float(scale),
                                 bool(causal))
