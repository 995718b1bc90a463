"""Public GDPA op: Triton kernels on CUDA (through an autograd Function that owns the
persistent schedules), PyTorch reference elsewhere."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import replace

import torch

from gem_kernels.dispatch import Kernel, resolve_kernel, same_dtype
from gem_kernels.gdpa.activations import ACT_CODE
from gem_kernels.gdpa.reference import check_inputs, gdpa_reference
from gem_kernels.gdpa.schedule import Schedule, ScheduleCache, build_schedule
from gem_kernels.gdpa.triton_bwd import (
    dkdv_config,
    dq_config,
    launch_bwd,
    launch_bwd_one_pass,
    launch_bwd_one_pass_phased,
    launch_bwd_short_kv,
    launch_bwd_short_kv_stream,
    launch_bwd_short_q,
    one_pass_config,
    short_kv_config,
    short_kv_stream_config,
    short_q_config,
)
from gem_kernels.gdpa.triton_fwd import TileConfig, fwd_config, launch_fwd
from gem_kernels.gdpa.tuning import Tuner, length_bucket

_NORM_CODE = {"none": 0, "kv_len": 1, "max_len": 2}


_CACHE = ScheduleCache()
TUNER = Tuner()

# The heuristics are pure functions of a few ints: cached, so that a call builds no config.
_fwd_config = functools.lru_cache(maxsize=1024)(fwd_config)
_one_pass_config = functools.lru_cache(maxsize=1024)(one_pass_config)
_short_kv_stream_config = functools.lru_cache(maxsize=1024)(short_kv_stream_config)
_short_kv_config = functools.lru_cache(maxsize=1024)(short_kv_config)
_short_q_config = functools.lru_cache(maxsize=1024)(short_q_config)
_dkdv_config = functools.lru_cache(maxsize=1024)(dkdv_config)
_dq_config = functools.lru_cache(maxsize=1024)(dq_config)


def _as_offsets(offsets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int64 offsets on ``device``; the tensor itself when it already is (the schedule cache
    recognises offsets by identity)."""
    if offsets.dtype is torch.int64 and offsets.device == device:
        return offsets
    return offsets.to(device, torch.int64)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None
                         else torch.cuda.current_device())
    return int(os.environ.get("GEM_GDPA_INTERPRET_PROGRAMS", "3"))


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def schedule_for(rows_offsets: torch.Tensor, cols_offsets: torch.Tensor, heads: int,
                 cfg: TileConfig, device: torch.device,
                 cover_empty_rows: bool = False, blocks: str = "all") -> Schedule:
    """Persistent schedule of (sample, row block, head) items, cached per offsets pair;
    blocks selects a subset of each sample's row blocks (see schedule.build_items)."""
    key = (cfg.block_rows, cfg.block_cols, cfg.ctas_per_sm, heads, device, cover_empty_rows,
           blocks)

    def build() -> Schedule:
        sms = num_sms(device)
        return build_schedule(rows_offsets, cols_offsets, cfg.block_rows, cfg.block_cols,
                              heads, sms * cfg.ctas_per_sm, device, num_sms=sms,
                              cover_empty_rows=cover_empty_rows, blocks=blocks)

    return _CACHE.get(key, rows_offsets, cols_offsets, build)


def forward_schedule(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, heads: int,
                     cfg: TileConfig, max_kv: int, device: torch.device) -> Schedule:
    """Items over query blocks, or (kv_major) over whole short KV samples."""
    if cfg.kv_major:
        if max_kv > cfg.block_rows:
            raise ValueError(f"a kv_major forward config needs max_kv <= block_rows "
                             f"({cfg.block_rows}); got max_kv={max_kv}")
        return schedule_for(kv_offsets, q_offsets, heads, cfg, device, cover_empty_rows=True)
    return schedule_for(q_offsets, kv_offsets, heads, cfg, device)


SHORT_SIDE = 64  # a side this short fits one tile: the backward runs as one fused kernel


def backward_mode(max_q: int, max_kv: int, dtype: torch.dtype = torch.bfloat16) -> str:
    """'short_kv' (cross attention: one pass over Q per KV sample, no atomics), 'short_q'
    (pooled) or, for self attention, 'one_pass' (one pass over key blocks, dQ summed in fp32
    by atomics; S and act' computed once instead of twice) with 16-bit inputs and
    'two_kernel' (dK/dV and dQ kernels, deterministic; smaller tiles) with fp32 ones, whose
    one-pass tiles would not fit. 'short_kv_atomic' (one pass over query blocks, dK and dV
    summed by atomics) is kept for comparison. 'one_pass_phased' is the one-pass backward as
    three launches (first, middle, last key blocks: no zeroed fp32 buffer, no final cast);
    with default configs the op times it against 'one_pass' on its first call per shape
    class and keeps the faster (see one_pass_candidates); 'one_pass_phased_hoisted' is the
    phased plan with the last phase's partial-dQ load outside the software pipeline."""
    if max_kv <= SHORT_SIDE:
        return "short_kv"
    if max_q <= SHORT_SIDE:
        return "short_q"
    return "one_pass" if dtype.itemsize == 2 else "two_kernel"


def one_pass_candidates(max_q: int, max_kv: int, d: int) -> tuple[tuple[str, TileConfig], ...]:
    """(mode, config) plans of the long-KV backward, the heuristic default first: the
    atomic one-pass kernel and the phased one (128-key blocks, 8 warps), with dQ computed
    transposed (TileConfig.dq_transposed: a warpgroup MMA; ptxas sm_90, d=128: no mma.sync
    left and 24 KiB less shared memory) at 3 and 4 stages, and with dQ as the 32-row
    mma.sync product dS K (the previous plans).
    H200 (self, log-normal mean 470, gelu_tanh), the op's own timing in one run
    (docs/bench/gdpa_self.json): dQ transposed atomic / phased 1.626 / 1.627 ms at 3
    stages, 1.595 / 1.612 at 4; dS K 1.728 / 1.724. An earlier run: 64-key blocks with 4
    warps and two programs per SM 1.74-2.07 ms (one program's activation math was to overlap
    the other's matmuls; it did not pay), 64-key blocks with 8 warps 2.86: no longer timed."""
    cfg = _one_pass_config(max_q, max_kv, d)
    s4 = replace(cfg, num_stages=4)
    mma_sync = replace(cfg, dq_transposed=False)
    return (("one_pass", cfg), ("one_pass_phased", cfg),
            ("one_pass", s4), ("one_pass_phased", s4),
            ("one_pass", mma_sync), ("one_pass_phased", mma_sync))


def run_backward(mode: str, cfg: TileConfig | None, cfg_q: TileConfig | None, q, k, v, do,
                 q_offsets, kv_offsets, max_q, max_kv, act, norm_code, scale):
    """(dq, dk, dv) by one backward plan; cfg / cfg_q None: the heuristic configs."""
    d, heads = q.shape[-1], q.shape[1]
    if mode == "short_kv":
        cfg = cfg or _short_kv_stream_config(max_kv, d)
        if max_kv > cfg.block_rows:
            raise ValueError(f"short_kv backward needs max_kv <= {cfg.block_rows}")
        sched = schedule_for(kv_offsets, q_offsets, heads, cfg, q.device,
                             cover_empty_rows=True)
        return launch_bwd_short_kv_stream(q, k, v, do, sched, cfg, act, norm_code, scale,
                                          max_kv)
    if mode == "short_kv_atomic":
        cfg = cfg_q or _short_kv_config(max_kv, d)
        if max_kv > cfg.block_cols:
            raise ValueError(f"short_kv backward needs max_kv <= {cfg.block_cols}")
        sched = schedule_for(q_offsets, kv_offsets, heads, cfg, q.device)
        return launch_bwd_short_kv(q, k, v, do, sched, cfg, act, norm_code, scale, max_kv)
    if mode == "short_q":
        cfg = cfg or _short_q_config(max_q, d)
        if max_q > cfg.block_cols:
            raise ValueError(f"short_q backward needs max_q <= {cfg.block_cols}")
        sched = schedule_for(kv_offsets, q_offsets, heads, cfg, q.device)
        return launch_bwd_short_q(q, k, v, do, sched, cfg, act, norm_code, scale, max_kv)
    if mode == "one_pass":
        cfg = cfg or _one_pass_config(max_q, max_kv, d)
        sched = schedule_for(kv_offsets, q_offsets, heads, cfg, q.device)
        return launch_bwd_one_pass(q, k, v, do, sched, cfg, act, norm_code, scale, max_kv)
    if mode in ("one_pass_phased", "one_pass_phased_hoisted"):
        cfg = cfg or _one_pass_config(max_q, max_kv, d)
        scheds = [schedule_for(kv_offsets, q_offsets, heads, cfg, q.device,
                               cover_empty_rows=(b == "first"), blocks=b)
                  for b in ("first", "middle", "last")]
        return launch_bwd_one_pass_phased(q, k, v, do, scheds, cfg, act, norm_code, scale,
                                          max_kv, hoisted=mode == "one_pass_phased_hoisted")
    if mode != "two_kernel":
        raise ValueError(f"unknown backward mode {mode!r}")
    cfg_kv = cfg or _dkdv_config(max_q, max_kv, d)
    cfg_q = cfg_q or _dq_config(max_q, max_kv, d)
    sched_kv = schedule_for(kv_offsets, q_offsets, heads, cfg_kv, q.device)
    sched_q = schedule_for(q_offsets, kv_offsets, heads, cfg_q, q.device)
    return launch_bwd(q, k, v, do, sched_kv, cfg_kv, sched_q, cfg_q, act, norm_code, scale,
                      max_kv)


class GDPAFunction(torch.autograd.Function):
    """Configs and bwd_mode default to the heuristics; the benchmark overrides them. In
    'short_kv_atomic' mode dq_cfg configures the fused kernel, in 'short_kv' and 'short_q'
    modes dkdv_cfg does."""

    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation, scale,
                norm_code, fwd_cfg=None, dkdv_cfg=None, dq_cfg=None, bwd_mode=None):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        q_offsets = _as_offsets(q_offsets, q.device)
        kv_offsets = _as_offsets(kv_offsets, q.device)
        d, heads = q.shape[-1], q.shape[1]
        cfg = fwd_cfg or _fwd_config(max_q, max_kv, d)
        sched = forward_schedule(q_offsets, kv_offsets, heads, cfg, max_kv, q.device)
        out = launch_fwd(q, k, v, sched, cfg, ACT_CODE[activation],
                         norm_code, scale, max_kv)
        ctx.save_for_backward(q, k, v, q_offsets, kv_offsets)
        ctx.meta = (max_q, max_kv, activation, scale, norm_code, dkdv_cfg, dq_cfg,
                    bwd_mode, bwd_mode or backward_mode(max_q, max_kv, q.dtype))
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, q_offsets, kv_offsets = ctx.saved_tensors
        max_q, max_kv, activation, scale, norm_code, dkdv_cfg, dq_cfg, asked, mode = ctx.meta
        act, do = ACT_CODE[activation], do.contiguous()
        args = (q, k, v, do, q_offsets, kv_offsets, max_q, max_kv, act, norm_code, scale)
        if mode == "one_pass" and asked is None and dkdv_cfg is None:
            d = q.shape[-1]
            key = ("one_pass", length_bucket(max_q), length_bucket(max_kv), d, q.dtype,
                   activation, q.device)
            mode, dkdv_cfg = TUNER.pick(
                key, one_pass_candidates(max_q, max_kv, d),
                lambda c: run_backward(c[0], c[1], None, *args), q.device)
        dq, dk, dv = run_backward(mode, dkdv_cfg, dq_cfg, *args)
        return (dq, dk, dv) + (None,) * 11


def triton_supported(q: torch.Tensor) -> bool:
    """The kernels take fp16/bf16/fp32 and a power-of-two head_dim in [16, 256]."""
    d = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and 16 <= d <= 256 and d & (d - 1) == 0)


def gdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
         kv_offsets: torch.Tensor, max_q: int, max_kv: int, *, activation: str = "silu",
         scale: float | None = None, norm: str = "none",
         kernel: Kernel | str | None = None) -> torch.Tensor:
    """Generalized dot-product attention on jagged Q and jagged KV, no softmax.

    out_i = sum over the KV rows j of i's sample of act(scale * q_i . k_j) * v_j, optionally
    divided by the sample's KV length (norm="kv_len"; 0 rows -> 0) or by max_kv
    (norm="max_len"). q: (total_q, H, d); k, v: (total_kv, H, d); q_offsets, kv_offsets:
    int64 (B+1,); max_q / max_kv >= the longest Q / KV sample. activation: "silu", "gelu",
    "gelu_tanh" or "identity" (the Triton path evaluates gelu_tanh by a polynomial, see
    activations.py). scale defaults to 1/sqrt(d). kernel: None/'auto' (Triton on CUDA,
    reference elsewhere), 'triton' or 'pytorch'. Returns (total_q, H, d) in the operands'
    common dtype (autocast's inside an autocast region).
    """
    q, k, v = same_dtype(q, k, v)
    check_inputs(q, k, v, q_offsets, kv_offsets, activation, norm)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    which = resolve_kernel(kernel, q, k, v)
    if which is Kernel.TRITON and not triton_supported(q):
        if kernel is not None and Kernel(kernel) is Kernel.TRITON:
            raise RuntimeError(f"the Triton GDPA kernels do not support dtype {q.dtype} / "
                               f"head_dim {q.shape[-1]}")
        which = Kernel.PYTORCH
    if which is Kernel.PYTORCH:
        return gdpa_reference(q, k, v, q_offsets, kv_offsets, max_q, max_kv,
                              activation=activation, scale=scale, norm=norm)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                         or v.requires_grad)):
        return gdpa_forward(q, k, v, q_offsets, kv_offsets, int(max_q), int(max_kv),
                            activation, float(scale), _NORM_CODE[norm])
    return GDPAFunction.apply(q, k, v, q_offsets, kv_offsets, int(max_q), int(max_kv),
                              activation, float(scale), _NORM_CODE[norm])


def gdpa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                 kv_offsets: torch.Tensor, max_q: int, max_kv: int, activation: str,
                 scale: float, norm_code: int, cfg: TileConfig | None = None) -> torch.Tensor:
    """The Triton forward alone (no autograd node): inference and no-grad calls skip the
    autograd Function's host overhead, which short shapes do not hide."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_offsets = _as_offsets(q_offsets, q.device)
    kv_offsets = _as_offsets(kv_offsets, q.device)
    cfg = cfg or _fwd_config(max_q, max_kv, q.shape[-1])
    sched = forward_schedule(q_offsets, kv_offsets, q.shape[1], cfg, max_kv, q.device)
    return launch_fwd(q, k, v, sched, cfg, ACT_CODE[activation], norm_code, scale, max_kv)
