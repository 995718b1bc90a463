"""Public jagged attention op: Triton kernels on CUDA (autograd forward and backward), the PyTorch
reference elsewhere. Launchers, tile configs and the autograd Function live here; the kernels are
in triton_fwd.py and triton_bwd.py, the tile schedule in schedule.py."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton

from gem_kernels.dispatch import Kernel, resolve_kernel, same_dtype
from gem_kernels.jagged_attention.reference import _check_inputs, jagged_attention_reference
from gem_kernels.jagged_attention.schedule import ScheduleCache
from gem_kernels.jagged_attention.triton_bwd import (
    _jfa_bwd_delta_kernel,
    _jfa_bwd_dkdv_kernel,
    _jfa_bwd_dq_kernel,
)
from gem_kernels.jagged_attention.triton_fwd import (
    BOUNDARY_MASK_ALL,
    BOUNDARY_TRICK,
    BOUNDARY_TRICK_FUSED,
    BOUNDARY_WHERE,
    LOG2E,
    _jfa_fwd_kernel,
)

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


def default_boundary(head_dim: int, causal: bool, window) -> str:
    """With causal/window masks: 'trick' (only band tiles are masked; 'mask_all' would mask
    every tile there too). Without: one key loop either way (a second loop for the partial
    tile drains the software pipeline: 'trick' and 'where' ran 3-7% slower). H200 (bench
    --tune, mix B256 H8): d=64 runs best with the fused boundary trick (0.532 ms vs 0.567
    masked), d=128 with every tile masked (0.959 ms vs 0.969 fused trick; log-normal 0.707
    vs 0.722)."""
    if causal or window is not None:
        return "trick"
    return "trick_fused" if head_dim <= 64 else "mask_all"
BOUNDARY_MODES = {"trick": BOUNDARY_TRICK, "trick_fused": BOUNDARY_TRICK_FUSED,
                  "where": BOUNDARY_WHERE, "mask_all": BOUNDARY_MASK_ALL}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_supported(q: torch.Tensor) -> bool:
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in SUPPORTED_HEAD_DIMS
            and (q.device.type == "cuda" or _interpret()))


def _tma_available(device: torch.device) -> bool:
    if _interpret():
        return True
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


# Load paths (the kernels' USE_TMA): masked pointer loads, per-sequence device-side tensor
# descriptors, or one host-side ragged descriptor per tensor (triton.tools.ragged_tma).
LOAD_PTR, LOAD_TMA_DEVICE, LOAD_TMA_RAGGED = 0, 1, 2
LOAD_MODES = {"ptr": LOAD_PTR, "tma_device": LOAD_TMA_DEVICE, "tma_ragged": LOAD_TMA_RAGGED}
DEFAULT_TMA_MODE = LOAD_TMA_RAGGED


def _alloc(size: int, alignment: int, stream: int | None):
    return torch.empty(size, dtype=torch.int8, device="cpu" if _interpret() else "cuda")


def _load_mode(use_tma, device: torch.device) -> int:
    """use_tma: None (default for the device), a bool, or a name/number from LOAD_MODES."""
    if use_tma is None:
        mode = DEFAULT_TMA_MODE if _tma_available(device) else LOAD_PTR
    elif isinstance(use_tma, str):
        mode = LOAD_MODES[use_tma]
    elif isinstance(use_tma, bool):
        mode = DEFAULT_TMA_MODE if use_tma else LOAD_PTR
    else:
        mode = int(use_tma)
    if mode == LOAD_TMA_DEVICE:
        # Device-side descriptors need global scratch; the allocator is a context variable, so
        # set it on every launch (the backward runs on autograd's own thread).
        triton.set_allocator(_alloc)
    return mode


def _descs(mode: int, tensors, blocks, head_dim: int):
    """Ragged host descriptors for mode LOAD_TMA_RAGGED, else the tensors themselves (unused)."""
    if mode != LOAD_TMA_RAGGED:
        return list(tensors)
    from triton.tools.ragged_tma import create_ragged_descriptor

    out = []
    for t, b in zip(tensors, blocks, strict=True):
        flat = t.as_strided((t.shape[0], t.shape[1] * t.shape[2]), (t.stride(0), 1))
        out.append(create_ragged_descriptor(flat, [b, head_dim]))
    return out


@dataclass(frozen=True)
class FwdConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


@dataclass(frozen=True)
class BwdConfig:
    # dk/dv kernel: key block, query block walked
    kv_block_n: int = 64
    kv_block_m: int = 64
    kv_warps: int = 4
    kv_stages: int = 2
    # dq kernel: query block, key block walked
    q_block_m: int = 64
    q_block_n: int = 64
    q_warps: int = 4
    q_stages: int = 2


def default_fwd_config(head_dim: int, causal: bool, window) -> FwdConfig:
    if _interpret():
        return FwdConfig(32, 16, 4, 1)
    if window is not None and window[0] + window[1] < 256:
        # narrow band: 64-row tiles waste fewer keys at the band edges
        return FwdConfig(64, 64, 4, 2)
    if head_dim <= 64:
        # H200 (bench --tune, mix B256 H8 d=64): one warpgroup per 128-row tile, 64-key
        # tiles, 3 stages: 0.532 ms vs 0.717 for the d=128 tiles (8 warps) and 0.537-0.69
        # for the other nine shapes tried.
        return FwdConfig(128, 64, 4, 3)
    # H200 sweep (bench --sweep, log-normal batch, d=128): 128x128 tiles, 8 warps, 3 stages,
    # ragged TMA: 0.748 ms vs 0.759-0.921 ms for the other tiles and load paths tried.
    return FwdConfig(128, 128, 8, 3)


def default_bwd_config(head_dim: int, causal: bool, window) -> BwdConfig:
    if _interpret():
        return BwdConfig(32, 16, 4, 1, 32, 16, 4, 1)
    if head_dim <= 64 and not (window is not None and window[0] + window[1] < 256):
        # H200 (bench --tune, mix d=64): dK/dV walks 128-row query tiles, dQ owns 128-row
        # tiles with 8 warps: 1.65 ms vs 1.95 for the d=128 tiles.
        return BwdConfig(64, 128, 4, 2, 128, 64, 8, 2)
    # H200 sweep: 64x64 tiles, 4 warps, 2 stages for both kernels, ragged TMA (2.22 ms vs
    # 2.32-3.5 ms for 128-row tiles, 8 warps, 3 stages or the other load paths).
    return BwdConfig(64, 64, 4, 2, 64, 64, 4, 2)


def _rows_ok(x: torch.Tensor) -> torch.Tensor:
    """(T, H, D) with unit stride on D and D on H (any row stride, e.g. a slice of fused QKV)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2] or (x.stride(0) * x.element_size()) % 16:
        x = x.contiguous()
    return x


def _window_args(window) -> tuple[bool, int, int]:
    if window is None:
        return False, 0, 0
    return True, int(window[0]), int(window[1])


def jfa_forward(q, k, v, offsets, *, causal, window, scale, sched: ScheduleCache,
                config: FwdConfig | None = None, boundary: str | None = None,
                use_tma=None):
    """Returns (out, lse) with lse (H, T) fp32 base-2. ``boundary``: how the partial key tile
    at a sequence end is handled without causal/window masks (BOUNDARY_MODES)."""
    T, H, D = q.shape
    boundary = boundary or default_boundary(D, causal, window)
    has_window, wl, wr = _window_args(window)
    cfg = config or default_fwd_config(D, causal, window)
    mode = _load_mode(use_tma, q.device)
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    s = sched.get(cfg.block_m)
    n_sched = s.shape[1]
    if T == 0 or H == 0:
        return out, lse
    grid = (H, n_sched)
    bm, bn = cfg.block_m, cfg.block_n
    descs = _descs(mode, (q, k, v, out), (bm, bn, bn, bm), D)
    _jfa_fwd_kernel[grid](
        q, k, v, out, *descs, lse, offsets, s, n_sched, T, scale * LOG2E,
        q.stride(0), k.stride(0), v.stride(0), out.stride(0), H, wl, wr,
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal),
        HAS_WINDOW=has_window, BOUNDARY=BOUNDARY_MODES[boundary], USE_TMA=mode,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


def jfa_backward(do, q, k, v, out, lse, offsets, *, causal, window, scale,
                 sched: ScheduleCache, config: BwdConfig | None = None,
                 use_tma=None):
    T, H, D = q.shape
    has_window, wl, wr = _window_args(window)
    cfg = config or default_bwd_config(D, causal, window)
    mode = _load_mode(use_tma, q.device)
    do = _rows_ok(do)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if T == 0 or H == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty((H, T), dtype=torch.float32, device=q.device)
    blk = 64 if D >= 128 else 128
    _jfa_bwd_delta_kernel[(triton.cdiv(T, blk), H)](
        out, do, delta, T, out.stride(0), do.stride(0), H, HEAD_DIM=D, BLOCK=blk,
        num_warps=4)
    qk_scale = scale * LOG2E
    s_kv = sched.get(cfg.kv_block_n)
    bm, bn = cfg.kv_block_m, cfg.kv_block_n
    descs = _descs(mode, (q, k, v, do, dk, dv), (bm, bn, bn, bm, bn, bn), D)
    _jfa_bwd_dkdv_kernel[(H, s_kv.shape[1])](
        q, k, v, do, dk, dv, *descs, lse, delta, offsets, s_kv, s_kv.shape[1], T, scale, qk_scale,
        q.stride(0), k.stride(0), v.stride(0), do.stride(0), dk.stride(0), dv.stride(0), H,
        wl, wr, HEAD_DIM=D, BLOCK_M=cfg.kv_block_m, BLOCK_N=cfg.kv_block_n,
        CAUSAL=bool(causal), HAS_WINDOW=has_window, USE_TMA=mode,
        num_warps=cfg.kv_warps, num_stages=cfg.kv_stages,
    )
    s_q = sched.get(cfg.q_block_m)
    bm, bn = cfg.q_block_m, cfg.q_block_n
    descs = _descs(mode, (q, k, v, do, dq), (bm, bn, bn, bm, bm), D)
    _jfa_bwd_dq_kernel[(H, s_q.shape[1])](
        q, k, v, do, dq, *descs, lse, delta, offsets, s_q, s_q.shape[1], T, scale, qk_scale,
        q.stride(0), k.stride(0), v.stride(0), do.stride(0), dq.stride(0), H, wl, wr,
        HEAD_DIM=D, BLOCK_M=cfg.q_block_m, BLOCK_N=cfg.q_block_n, CAUSAL=bool(causal),
        HAS_WINDOW=has_window, USE_TMA=mode,
        num_warps=cfg.q_warps, num_stages=cfg.q_stages,
    )
    return dq, dk, dv


class _JaggedAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, causal, window, scale, deterministic, options):
        sched = ScheduleCache(offsets, q.shape[0])
        out, lse = jfa_forward(q, k, v, offsets, causal=causal, window=window, scale=scale,
                               sched=sched, **options.get("fwd", {}))
        ctx.save_for_backward(q, k, v, out, lse, offsets)
        ctx.sched = sched
        ctx.causal, ctx.window, ctx.scale = causal, window, scale
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, offsets = ctx.saved_tensors
        dq, dk, dv = jfa_backward(do, q, k, v, out, lse, offsets, causal=ctx.causal,
                                  window=ctx.window, scale=ctx.scale, sched=ctx.sched,
                                  **ctx.options.get("bwd", {}))
        return dq, dk, dv, None, None, None, None, None, None


def jagged_attention_triton(q, k, v, offsets, max_len, *, causal=False, window=None, scale=None,
                            deterministic=False, options: dict | None = None):
    """Triton path of ``jagged_attention``. ``deterministic`` is accepted for the common
    signature: this backward uses no atomics and is always bitwise reproducible.
    ``options`` (benchmarks and tests): {"fwd": {config, boundary, use_tma}, "bwd": {config,
    use_tma}}."""
    del max_len
    q, k, v = _rows_ok(q), _rows_ok(k), _rows_ok(v)
    offsets = offsets.to(device=q.device, dtype=torch.int64).contiguous()
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if window is not None:
        window = (int(window[0]), int(window[1]))
    return _JaggedAttentionFn.apply(q, k, v, offsets, bool(causal), window, float(scale),
                                    bool(deterministic), options or {})


def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     max_len: int, *, causal: bool = False,
                     window: tuple[int, int] | None = None, scale: float | None = None,
                     kernel: Kernel | str | None = None,
                     deterministic: bool = False) -> torch.Tensor:
    """Softmax attention within each sequence of a jagged batch, no padding.

    q, k, v: (total_tokens, heads, head_dim) bf16/fp16 (fp32 accumulate; fp32 runs on the
    reference); offsets: int64 (B+1,); max_len >= the longest sequence. ``causal`` keeps keys
    j <= i; ``window=(left, right)`` keeps i-left <= j <= i+right (both may be given). ``scale``
    defaults to 1/sqrt(head_dim). A query with no valid key outputs 0. ``kernel``: None/'auto'
    (Triton on CUDA, reference elsewhere), 'triton' or 'pytorch'. ``deterministic=True`` makes
    the backward bitwise reproducible. Returns (total_tokens, heads, head_dim) in the operands'
    common dtype (autocast's inside an autocast region).
    """
    q, k, v = same_dtype(q, k, v)
    _check_inputs(q, k, v, offsets, window)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    which = resolve_kernel(kernel, q, k, v)
    if which is Kernel.PYTORCH:
        return jagged_attention_reference(q, k, v, offsets, max_len, causal=causal,
                                          window=window, scale=scale)
    if not triton_supported(q):
        if kernel is not None and Kernel(kernel) is Kernel.TRITON:
            raise RuntimeError(f"the Triton jagged attention kernel does not support dtype "
                               f"{q.dtype} / head_dim {q.shape[-1]}")
        return jagged_attention_reference(q, k, v, offsets, max_len, causal=causal,
                                          window=window, scale=scale)
    return jagged_attention_triton(q, k, v, offsets, max_len, causal=causal, window=window,
                                   scale=scale, deterministic=deterministic)
