"""Autograd wiring for the Triton block attention kernels: block plan, launch settings, grid."""

from __future__ import annotations

import functools
import weakref

import torch
import triton

from gem_kernels.block_attention import triton_kernels as tk
from gem_kernels.block_attention.rope import Rope, RopeConfig, rope_tables_for
from gem_kernels.dispatch import interpreting

_PLAN_MAX_BATCH = 16384  # the plan is one program over the whole batch up to this size
_INTERPRET_META = {"CTAS": 1, "num_warps": 4}

# Launch settings. CTAS: at most that many persistent programs per SM (fewer when its registers
# or shared memory hold fewer, see _resident_per_sm). STRIDE: program p takes items p, p + P, ...
# (else one contiguous chunk each). VEC_PLAN: how the plan row is read, which decides how far
# Triton's pipeliner prefetches (triton_kernels._plan_entry). HOIST keeps the block-relative
# RoPE table in registers; SPLIT_PV does P V in two column halves. Defaults: what the autotuner
# chose with RoPE on the H200 (block_attention/DESIGN.md says how they compared).
DEFAULT_META = {
    64: ({"CTAS": 4, "num_warps": 4, "num_stages": 3, "HOIST": True, "SPLIT_PV": True,
          "STRIDE": True, "VEC_PLAN": False},
         {"CTAS": 2, "num_warps": 4, "num_stages": 2, "STRIDE": True, "VEC_PLAN": False}),
    128: ({"CTAS": 2, "num_warps": 4, "num_stages": 3, "HOIST": True, "SPLIT_PV": True,
           "STRIDE": True, "VEC_PLAN": False},
          {"CTAS": 2, "num_warps": 4, "num_stages": 1, "STRIDE": True, "VEC_PLAN": False}),
}

def _fwd(ctas: int, stages: int, vec: bool, stride: bool = True, hoist: bool = True,
         split: bool = True, warps: int = 4) -> dict:
    return {"CTAS": ctas, "num_warps": warps, "num_stages": stages, "HOIST": hoist,
            "SPLIT_PV": split, "STRIDE": stride, "VEC_PLAN": vec}


def _bwd(ctas: int, stages: int, vec: bool, stride: bool, warps: int = 4) -> dict:
    return {"CTAS": ctas, "num_warps": warps, "num_stages": stages, "STRIDE": stride,
            "VEC_PLAN": vec}


# What use_autotune times per head_dim: the settings that came out best (or close) in a sweep
# of the H200, the previous defaults among them.
TUNE_SPACE = {
    "fwd": {
        128: [_fwd(2, 3, False, stride, hoist) for stride in (True, False)
              for hoist in (True, False)]
        + [_fwd(2, 3, False, split=False), _fwd(2, 2, True), _fwd(2, 2, True, stride=False),
           _fwd(1, 3, True)],
        64: [_fwd(3, 3, True, split=False), _fwd(3, 3, True), _fwd(4, 2, True),
             _fwd(4, 2, False, stride=False), _fwd(4, 3, False)],
    },
    "bwd": {
        128: [_bwd(2, 1, vec, stride) for vec in (True, False) for stride in (True, False)],
        64: [_bwd(2, 2, True, True), _bwd(2, 2, True, False), _bwd(2, 2, False, True)],
    },
}
TUNED: dict[tuple, dict] = {}
_AUTOTUNE = False


def use_autotune(enabled: bool) -> None:
    """Time TUNE_SPACE once per (direction, head_dim, heads, rope, causal, dtype) on first use
    and keep the fastest; off by default so that tests do not pay for the tuning compiles."""
    global _AUTOTUNE
    _AUTOTUNE = bool(enabled)



def build_plan(offsets: torch.Tensor, total_tokens: int, block: int
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(max_blocks, 4) int32 [start token, length, first position, 0] per block, the real
    block count as a 1-element device tensor, and max_blocks, an upper bound known without a
    sync."""
    batch = offsets.numel() - 1
    if batch > _PLAN_MAX_BATCH:
        raise ValueError(f"block_attention supports batches up to {_PLAN_MAX_BATCH} sequences "
                         f"per call; got {batch}")
    max_blocks = total_tokens // block + batch
    plan = torch.empty(max(max_blocks, 1), 4, dtype=torch.int32, device=offsets.device)
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


_RESIDENT: dict[tuple, int] = {}


def _resident_per_sm(which: str, kernel, args: tuple, consts: dict,  # noqa: ANN001
                     meta: dict, device: torch.device) -> int:
    """How many programs of this compiled kernel one SM holds at once (registers, shared
    memory, threads). The grid is persistent: programs beyond that would run as a second wave
    after the first, doubling the tail instead of sharing the work (the pipelined forward at
    head_dim 128 takes 128 KiB of shared memory, so one program per SM)."""
    key = (which, args[0].dtype, device, tuple(sorted(consts.items())),
           tuple(sorted(meta.items())))
    fit = _RESIDENT.get(key)
    if fit is None:
        compiled = kernel.warmup(*args, grid=(1,), **consts, **meta)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        compiled._init_handles()
        props = torch.cuda.get_device_properties(device)
        threads = meta["num_warps"] * props.warp_size
        regs = -(-max(compiled.n_regs, 1) // 8) * 8 * threads  # allocated in 8-register steps
        fit = min(getattr(props, "regs_per_multiprocessor", 65536) // regs,
                  props.max_threads_per_multi_processor // threads)
        if compiled.metadata.shared:  # the driver reserves 1 KiB per program on sm_80+
            fit = min(fit, props.shared_memory_per_multiprocessor
                      // (compiled.metadata.shared + 1024))
        fit = _RESIDENT[key] = max(fit, 1)
    return fit


def _grid(which: str, kernel, args: tuple, consts: dict, meta: dict,  # noqa: ANN001
          max_items: int, device: torch.device) -> tuple[int]:
    """At most CTAS programs per SM, and no more than fit on it at once."""
    if interpreting():
        return (max(min(max_items, 4), 1),)
    index = device.index if device.index is not None else torch.cuda.current_device()
    per_sm = min(meta["CTAS"], _resident_per_sm(which, kernel, args, consts, meta,
                                                torch.device("cuda", index)))
    return (max(min(max_items, _sm_count(index) * per_sm), 1),)


def _tune(which: str, kernel, args: tuple, consts: dict, space: list[dict],  # noqa: ANN001
          max_items: int, device: torch.device) -> dict:
    from triton.testing import do_bench

    if not (consts["ROPE"] and consts["REL"]):  # HOIST only matters for the one shared table
        unique = []
        for m in space:
            m = {**m, "HOIST": False} if "HOIST" in m else m
            if m not in unique:
                unique.append(m)
        space = unique
    best, best_ms = None, float("inf")
    for meta in space:
        try:
            grid = _grid(which, kernel, args, consts, meta, max_items, device)
            kernel[grid](*args, **consts, **meta)
            ms = do_bench(lambda meta=meta, grid=grid: kernel[grid](*args, **consts, **meta),
                          warmup=10, rep=50, return_mode="median")
        except triton.runtime.errors.OutOfResources:
            continue
        if ms < best_ms:
            best, best_ms = meta, ms
    if best is None:
        raise RuntimeError("no launch setting of the block attention kernel fits this GPU")
    return best


def _launch(which: str, kernel, args: tuple, consts: dict, max_items: int,  # noqa: ANN001
            device: torch.device, heads: int, autotune: bool) -> None:
    d = consts["D"]
    meta = DEFAULT_META[d][0 if which == "fwd" else 1]
    if interpreting():  # the default code path, small launch
        meta = {**meta, **_INTERPRET_META}
        kernel[_grid(which, kernel, args, consts, meta, max_items, device)](*args, **consts,
                                                                            **meta)
        return
    if autotune:
        key = (which, d, heads, consts["ROPE"], consts["REL"], consts["CAUSAL"], args[0].dtype)
        if key not in TUNED:
            TUNED[key] = _tune(which, kernel, args, consts, TUNE_SPACE[which][d], max_items,
                               device)
        meta = TUNED[key]
    kernel[_grid(which, kernel, args, consts, meta, max_items, device)](*args, **consts, **meta)


def _strides(x: torch.Tensor) -> tuple[int, int]:
    return x.stride(0), x.stride(1)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, block, cos, sin, rel, scale, causal,  # noqa: ANN001
                autotune):
        total, heads, dim = q.shape
        plan, nblk, max_blocks = cached_plan(offsets, total, block)
        o = torch.empty(total, heads, dim, dtype=q.dtype, device=q.device)
        rope = cos is not None
        args = (q, k, v, o, plan, nblk, cos if rope else q, sin if rope else q,
                *_strides(q), *_strides(k), *_strides(v), *_strides(o), heads,
                scale * tk.LOG2E)
        consts = {"BLOCK": block, "D": dim, "ROPE": rope, "CAUSAL": causal, "REL": rel}
        _launch("fwd", tk.fwd_kernel, args, consts, max_blocks * heads, q.device, heads,
                autotune)
        ctx.save_for_backward(q, k, v, plan, nblk, cos, sin)
        ctx.meta = (block, rel, scale, causal, max_blocks, autotune)
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
        _launch("bwd", tk.bwd_kernel, args, consts, max_blocks * heads, q.device, heads,
                autotune)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def block_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           offsets: torch.Tensor, *, block: int, rope: Rope | None,
                           scale: float, causal: bool, deterministic: bool = False
                           ) -> torch.Tensor:
    """Triton block attention; q, k, v may be strided views (last dim contiguous).
    ``deterministic``: the default launch settings, never the autotuner's timing-based choice
    (use_autotune), so that two processes run the same compiled kernels."""
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
                                 bool(causal), _AUTOTUNE and not deterministic)
