"""Autograd wiring for the Triton block attention kernels: plan, launch, persistent grid."""

from __future__ import annotations

import os

import torch
import triton

from gem_kernels.block_attention import triton_kernels as tk
from gem_kernels.block_attention.rope import Rope, rope_tables_for

_PLAN_MAX_BATCH = 16384  # the plan is one program over the whole batch up to this size
_INTERPRET_META = {"CTAS": 1, "num_warps": 4}
# Launch settings per head_dim when not autotuning (CTAS: resident programs per SM).
DEFAULT_META = {
    64: ({"CTAS": 8, "num_warps": 4, "num_stages": 1},
         {"CTAS": 4, "num_warps": 4, "num_stages": 1}),
    128: ({"CTAS": 4, "num_warps": 4, "num_stages": 1},
          {"CTAS": 2, "num_warps": 8, "num_stages": 1}),
}
_AUTOTUNE = False


def use_autotune(enabled: bool) -> None:
    """Autotune launch settings per (head_dim, heads, rope, causal) on first use (benchmarks);
    off by default so that tests and first steps do not pay for tuning compiles."""
    global _AUTOTUNE
    _AUTOTUNE = bool(enabled)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_supported(q: torch.Tensor, block: int) -> bool:
    """The kernels cover fp16/bf16, head_dim 64/128 and block 64 (other shapes: reference)."""
    return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)
            and block == 64 and q.stride(-1) == 1)


def build_plan(offsets: torch.Tensor, total_tokens: int, block: int
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(max_blocks, 3) int32 [start token, length, first position] per block, the real block
    count as a 1-element device tensor, and max_blocks, an upper bound known without a sync."""
    batch = offsets.numel() - 1
    max_blocks = total_tokens // block + batch
    plan = torch.empty(max(max_blocks, 1), 3, dtype=torch.int32, device=offsets.device)
    nblk = torch.empty(1, dtype=torch.int32, device=offsets.device)
    if batch > _PLAN_MAX_BATCH:
        raise ValueError(f"block_attention supports batches up to {_PLAN_MAX_BATCH} sequences "
                         f"per call; got {batch}")
    bb = max(triton.next_power_of_2(max(batch, 1)), 16)
    tk.plan_kernel[(1,)](offsets, plan, nblk, batch, BLOCK=block, BB=bb,
                         num_warps=4 if bb <= 2048 else 8)
    return plan, nblk, max_blocks


def _grid(max_items: int, device: torch.device):
    if _interpreting():
        return lambda meta: (max(min(max_items, 4), 1),)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return lambda meta: (max(min(max_items, sms * meta["CTAS"]), 1),)


def _strides(x: torch.Tensor) -> tuple[int, int]:
    return x.stride(0), x.stride(1)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, block, cos, sin, scale, causal):  # noqa: ANN001
        total, heads, dim = q.shape
        plan, nblk, max_blocks = build_plan(offsets, total, block)
        o = torch.empty(total, heads, dim, dtype=q.dtype, device=q.device)
        rope = cos is not None
        cos_t = cos if rope else q
        sin_t = sin if rope else q
        args = (q, k, v, o, plan, nblk, cos_t, sin_t, *_strides(q), *_strides(k), *_strides(v),
                *_strides(o), heads, scale * tk.LOG2E)
        consts = {"BLOCK": block, "D": dim, "ROPE": rope, "CAUSAL": causal}
        grid = _grid(max_blocks * heads, q.device)
        if _interpreting():
            tk.fwd_kernel[grid](*args, **consts, **_INTERPRET_META)
        elif _AUTOTUNE:
            tk.fwd_kernel_tuned[grid](*args, **consts)
        else:
            tk.fwd_kernel[grid](*args, **consts, **DEFAULT_META[dim][0])
        ctx.save_for_backward(q, k, v, plan, nblk, cos, sin)
        ctx.meta = (block, scale, causal, max_blocks, _AUTOTUNE)
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001
        q, k, v, plan, nblk, cos, sin = ctx.saved_tensors
        block, scale, causal, max_blocks, autotune = ctx.meta
        total, heads, dim = q.shape
        if do.stride(-1) != 1:
            do = do.contiguous()
        grads = torch.empty(3, total, heads, dim, dtype=q.dtype, device=q.device)
        dq, dk, dv = grads[0], grads[1], grads[2]
        rope = cos is not None
        cos_t = cos if rope else q
        sin_t = sin if rope else q
        args = (q, k, v, do, dq, dk, dv, plan, nblk, cos_t, sin_t, *_strides(q), *_strides(k),
                *_strides(v), *_strides(do), *_strides(dq), heads, scale * tk.LOG2E, scale)
        consts = {"BLOCK": block, "D": dim, "ROPE": rope, "CAUSAL": causal}
        grid = _grid(max_blocks * heads, q.device)
        if _interpreting():
            tk.bwd_kernel[grid](*args, **consts, **_INTERPRET_META)
        elif autotune:
            tk.bwd_kernel_tuned[grid](*args, **consts)
        else:
            tk.bwd_kernel[grid](*args, **consts, **DEFAULT_META[dim][1])
        return dq, dk, dv, None, None, None, None, None, None


def block_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           offsets: torch.Tensor, *, block: int, rope: Rope | None,
                           scale: float, causal: bool) -> torch.Tensor:
    """Triton block attention; q, k, v may be strided views (last dim contiguous)."""
    total, _, dim = q.shape
    if total == 0:
        return torch.empty_like(q)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    offsets = offsets.to(device=q.device, dtype=torch.int64).contiguous()
    cos = sin = None
    if rope is not None:
        tables = rope_tables_for(rope, total, dim, q.device)
        cos, sin = tables.cos, tables.sin
    return _BlockAttention.apply(q, k, v, offsets, block, cos, sin, float(scale), bool(causal))
