"""Public jagged attention op: Triton kernels on CUDA (autograd forward and backward), the PyTorch
reference elsewhere. Launchers, tile configs and the autograd Function live here; the kernels are
in triton_fwd.py and triton_bwd.py, the tile schedule in schedule.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from gem_kernels.dispatch import Kernel, interpreting, resolve_kernel, same_dtype
from gem_kernels.jagged_attention.reference import check_inputs, jagged_attention_reference
from gem_kernels.jagged_attention.schedule import ScheduleCache
from gem_kernels.jagged_attention.triton_bwd import (
    _jfa_bwd_delta_kernel,
    _jfa_bwd_dkdv_kernel,
    _jfa_bwd_dq_kernel,
)
from gem_kernels.jagged_attention.triton_common import (
    LOAD_PTR,
    LOAD_TMA_DEVICE,
    LOAD_TMA_RAGGED,
    LOG2E,
)
from gem_kernels.jagged_attention.triton_fwd import (
    BOUNDARY_MASK_ALL,
    BOUNDARY_TRICK,
    BOUNDARY_TRICK_FUSED,
    BOUNDARY_WHERE,
    _jfa_fwd_kernel,
)

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


def default_boundary(head_dim: int, causal: bool, window) -> str:
    """How the forward handles the partial key tile at a sequence end (BOUNDARY_MODES):
    'trick' with causal/window masks (only band tiles are masked), else one key loop:
    'trick_fused' for head_dim <= 64, 'mask_all' above. Why: jagged_attention/DESIGN.md."""
    if causal or window is not None:
        return "trick"
    return "trick_fused" if head_dim <= 64 else "mask_all"


BOUNDARY_MODES = {"trick": BOUNDARY_TRICK, "trick_fused": BOUNDARY_TRICK_FUSED,
                  "where": BOUNDARY_WHERE, "mask_all": BOUNDARY_MASK_ALL}



def triton_unsupported(q: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot take ``q`` (they take fp16/bf16 and head_dim in
    SUPPORTED_HEAD_DIMS), or None when they can."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"takes fp16/bf16 inputs, not {q.dtype}"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"takes head_dim in {SUPPORTED_HEAD_DIMS}, not {q.shape[-1]}"
    return None


def _tma_available(device: torch.device) -> bool:
    if interpreting():
        return True
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


LOAD_MODES = {"ptr": LOAD_PTR, "tma_device": LOAD_TMA_DEVICE, "tma_ragged": LOAD_TMA_RAGGED}
DEFAULT_TMA_MODE = LOAD_TMA_RAGGED


def _alloc(size: int, alignment: int, stream: int | None):
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpreting() else "cuda")


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
    """Forward tiles: small ones under the interpreter, 64x64 for a narrow window band (fewer
    wasted keys at its edges), else 128-row query tiles (64-key with one warpgroup at
    head_dim <= 64, 128-key with 8 warps above). Why: jagged_attention/DESIGN.md."""
    if interpreting():
        return FwdConfig(32, 16, 4, 1)
    if window is not None and window[0] + window[1] < 256:
        return FwdConfig(64, 64, 4, 2)
    if head_dim <= 64:
        return FwdConfig(128, 64, 4, 3)
    return FwdConfig(128, 128, 8, 3)


def default_bwd_config(head_dim: int, causal: bool, window) -> BwdConfig:
    """Backward tiles: small ones under the interpreter; at head_dim <= 64 without a narrow
    window, 128-row query tiles for both kernels (dQ with 8 warps); else 64x64 tiles, 4 warps,
    2 stages. Why: jagged_attention/DESIGN.md."""
    if interpreting():
        return BwdConfig(32, 16, 4, 1, 32, 16, 4, 1)
    if head_dim <= 64 and not (window is not None and window[0] + window[1] < 256):
        return BwdConfig(64, 128, 4, 2, 128, 64, 8, 2)
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
    def forward(ctx, q, k, v, offsets, causal, window, scale, options):
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
        return dq, dk, dv, None, None, None, None, None


def jagged_attention_triton(q, k, v, offsets, max_len, *, causal=False, window=None, scale=None,
                            options: dict | None = None):
    """Triton path of ``jagged_attention``; its backward uses no atomics and is always bitwise
    reproducible. ``options`` (benchmarks and tests): {"fwd": {config, boundary, use_tma},
    "bwd": {config, use_tma}}."""
    del max_len
    q, k, v = _rows_ok(q), _rows_ok(k), _rows_ok(v)
    offsets = offsets.to(device=q.device, dtype=torch.int64).contiguous()
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if window is not None:
        window = (int(window[0]), int(window[1]))
    return _JaggedAttentionFn.apply(q, k, v, offsets, bool(causal), window, float(scale),
                                    options or {})


def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     max_len: int, *, causal: bool = False,
                     window: tuple[int, int] | None = None, scale: float | None = None,
                     kernel: Kernel | str | None = None,
                     deterministic: bool | None = None) -> torch.Tensor:
    """Softmax attention within each sequence of a jagged batch, no padding.

    q, k, v: (total_tokens, heads, head_dim) bf16/fp16 (fp32 accumulate; fp32 runs on the
    reference); offsets: int64 (B+1,); max_len >= the longest sequence. ``causal`` keeps keys
    j <= i; ``window=(left, right)`` keeps i-left <= j <= i+right (both may be given). ``scale``
    defaults to 1/sqrt(head_dim). A query with no valid key outputs 0. ``kernel``: None/'auto'
    (Triton on CUDA, reference elsewhere), 'triton' or 'pytorch'. ``deterministic`` is
    accepted for the ops' common signature (gem_kernels.dispatch): the Triton backward uses no
    atomics and is bitwise reproducible either way. Returns (total_tokens, heads, head_dim) in
    the operands' common dtype (autocast's inside an autocast region).
    """
    del deterministic  # always deterministic
    q, k, v = same_dtype(q, k, v)
    check_inputs(q, k, v, offsets, window)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    which = resolve_kernel(kernel, q, k, v, unsupported=triton_unsupported(q),
                           op="jagged_attention")
    if which is Kernel.PYTORCH:
        return jagged_attention_reference(q, k, v, offsets, max_len, causal=causal,
                                          window=window, scale=scale)
    return jagged_attention_triton(q, k, v, offsets, max_len, causal=causal, window=window,
                                   scale=scale)
