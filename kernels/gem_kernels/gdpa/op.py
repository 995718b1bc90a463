"""Public GDPA op: Triton kernels on CUDA (through an autograd Function that owns the
persistent schedules), PyTorch reference elsewhere (gem_kernels.dispatch's rule). The backward
runs one of the BackwardMode plans: the fastest for the shape, or, when
gem_kernels.dispatch.deterministic_backward() says so, one without floating-point atomics."""

from __future__ import annotations

import enum
import functools
import math
import os
from dataclasses import replace
from typing import NamedTuple

import torch

from gem_kernels.dispatch import Kernel, deterministic_backward, resolve_kernel, same_dtype
from gem_kernels.gdpa.activations import ACT_CODE
from gem_kernels.gdpa.reference import check_inputs, gdpa_reference
from gem_kernels.gdpa.schedule import (
    Schedule,
    ScheduleCache,
    SchedulePlanner,
    ScheduleSpec,
    upload_schedules,
)
from gem_kernels.gdpa.triton_bwd import (
    dkdv_config,
    dq_config,
    launch_bwd,
    launch_bwd_one_pass,
    launch_bwd_one_pass_phased,
    launch_bwd_short_kv,
    launch_bwd_short_kv_stream,
    launch_bwd_short_q,
    launch_bwd_short_q_stream,
    one_pass_config,
    short_kv_config,
    short_kv_stream_config,
    short_q_config,
    short_q_stream_config,
)
from gem_kernels.gdpa.triton_common import TileConfig
from gem_kernels.gdpa.triton_fwd import fwd_config, launch_fwd
from gem_kernels.gdpa.tuning import Tuner, length_bucket, tuning_enabled

_NORM_CODE = {"none": 0, "kv_len": 1, "max_len": 2}


_CACHE = ScheduleCache()
TUNER = Tuner()

# The heuristics are pure functions of a few ints: cached, so that a call builds no config.
_fwd_config = functools.lru_cache(maxsize=1024)(fwd_config)
_one_pass_config = functools.lru_cache(maxsize=1024)(one_pass_config)
_short_kv_stream_config = functools.lru_cache(maxsize=1024)(short_kv_stream_config)
_short_kv_config = functools.lru_cache(maxsize=1024)(short_kv_config)
_short_q_config = functools.lru_cache(maxsize=1024)(short_q_config)
_short_q_stream_config = functools.lru_cache(maxsize=1024)(short_q_stream_config)
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


class ScheduleRequest(NamedTuple):
    """One schedule a call needs: items over ``rows``' row blocks against ``cols`` (offsets),
    tiled by ``cfg``; cover and blocks: schedule.build_items' cover_empty_rows and blocks."""

    rows: torch.Tensor
    cols: torch.Tensor
    cfg: TileConfig
    cover: bool = False
    blocks: str = "all"


def _cache_key(req: ScheduleRequest, heads: int, device: torch.device) -> tuple:
    c = req.cfg
    return (c.block_rows, c.block_cols, c.ctas_per_sm, heads, device, req.cover, req.blocks)


def schedules_for(requests: list[ScheduleRequest], heads: int, device: torch.device
                  ) -> list[Schedule]:
    """Persistent schedules of (sample, row block, head) items, cached per offsets pair and
    config. Those not cached are built together (one schedule.SchedulePlanner per offsets
    pair: what they share is computed once) and reach the device in one copy."""
    out: list[Schedule | None] = [None] * len(requests)
    todo: dict[tuple, list[int]] = {}
    for i, req in enumerate(requests):
        key = _cache_key(req, heads, device)
        out[i] = _CACHE.lookup(key, req.rows, req.cols)
        if out[i] is None:
            todo.setdefault((key, id(req.rows), id(req.cols)), []).append(i)
    if not todo:
        return out
    sms = num_sms(device)
    planners: dict[tuple[int, int], SchedulePlanner] = {}
    hosts = []
    for (_, id_rows, id_cols), where in todo.items():
        req = requests[where[0]]
        planner = planners.get((id_rows, id_cols))
        if planner is None:
            planner = planners[id_rows, id_cols] = SchedulePlanner(req.rows, req.cols)
        c = req.cfg
        hosts.append(planner.plan(ScheduleSpec(c.block_rows, c.block_cols, heads,
                                               sms * c.ctas_per_sm, sms, req.cover,
                                               req.blocks)))
    for (key, _, _), where, sched in zip(todo, todo.values(), upload_schedules(hosts, device),
                                          strict=True):
        req = requests[where[0]]
        _CACHE.put(key, req.rows, req.cols, sched)
        for i in where:
            out[i] = sched
    return out


def schedule_for(rows_offsets: torch.Tensor, cols_offsets: torch.Tensor, heads: int,
                 cfg: TileConfig, device: torch.device,
                 cover_empty_rows: bool = False, blocks: str = "all") -> Schedule:
    """One schedule of ``schedules_for``; blocks selects a subset of each sample's row blocks
    (see schedule.build_items)."""
    req = ScheduleRequest(rows_offsets, cols_offsets, cfg, cover_empty_rows, blocks)
    return schedules_for([req], heads, device)[0]


def forward_request(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, cfg: TileConfig,
                    max_kv: int) -> ScheduleRequest:
    """Items over query blocks, or (kv_major) over whole short KV samples."""
    if cfg.kv_major:
        if max_kv > cfg.block_rows:
            raise ValueError(f"a kv_major forward config needs max_kv <= block_rows "
                             f"({cfg.block_rows}); got max_kv={max_kv}")
        return ScheduleRequest(kv_offsets, q_offsets, cfg, cover=True)
    return ScheduleRequest(q_offsets, kv_offsets, cfg)


def forward_schedule(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, heads: int,
                     cfg: TileConfig, max_kv: int, device: torch.device) -> Schedule:
    """The forward's schedule (forward_request)."""
    return schedules_for([forward_request(q_offsets, kv_offsets, cfg, max_kv)], heads,
                         device)[0]


SHORT_SIDE = 64  # a side this short fits one tile: the backward runs as one fused kernel


class BackwardMode(str, enum.Enum):
    """A backward launch plan (gem_kernels.gdpa.triton_bwd has the kernels); prints as its
    value."""

    SHORT_KV = "short_kv"  # KV <= 64 rows: one pass, a sample's whole KV per item, no atomics
    SHORT_KV_ATOMIC = "short_kv_atomic"  # KV <= 64 rows: over query blocks, dK/dV by atomics
    SHORT_Q = "short_q"  # Q <= 64 rows: over key blocks, dQ summed by atomics
    SHORT_Q_STREAM = "short_q_stream"  # Q <= 64 rows: a sample's whole Q per item, no atomics
    ONE_PASS = "one_pass"  # over key blocks, dQ summed by fp32 atomics
    ONE_PASS_PHASED = "one_pass_phased"  # ONE_PASS as first / middle / last key-block launches
    ONE_PASS_PHASED_HOISTED = "one_pass_phased_hoisted"  # phased, last phase's load hoisted
    TWO_KERNEL = "two_kernel"  # dK/dV over key blocks, then dQ over query blocks, no atomics

    def __str__(self) -> str:
        return self.value

    @property
    def deterministic(self) -> bool:
        """No floating-point atomics: the same inputs give bitwise-identical gradients."""
        return self in (BackwardMode.SHORT_KV, BackwardMode.SHORT_Q_STREAM,
                        BackwardMode.TWO_KERNEL)


# SHORT_Q_STREAM replaces SHORT_Q as the fast plan up to this many query rows (the measured
# 16-row query tile and the 32-row one use well under 255 registers; the 64-row one does not)
STREAM_MAX_Q = 32
# ... and only where the per-SM share of its (sample, head) items is at least this many times
# the longest item's work (why: gdpa/DESIGN.md).
STREAM_MIN_BALANCE = 1.5


def stream_balance(batch: int, heads: int, total_kv: int, max_kv: int, sms: int,
                   block_cols: int = 64) -> float:
    """How many times the longest (sample, head) item of SHORT_Q_STREAM fits in one SM's share
    of all items: heads * (total_kv / block_cols + batch) / sms over ceil(max_kv / block_cols)
    + 1 (an item's work counts its key blocks plus one, as schedule.item_work does; the sum
    of ceilings is bounded below by total_kv / block_cols, so this never overstates);
    block_cols: SHORT_Q_STREAM's key block (short_q_stream_config)."""
    if batch <= 0 or heads <= 0 or sms <= 0:
        raise ValueError(f"batch, heads and sms must be positive; got {batch}, {heads}, {sms}")
    per_sm = heads * (total_kv / block_cols + batch) / sms
    return per_sm / (math.ceil(max(max_kv, 1) / block_cols) + 1)


def backward_mode(max_q: int, max_kv: int, dtype: torch.dtype = torch.bfloat16,
                  deterministic: bool = False, *, batch: int | None = None,
                  heads: int | None = None, total_kv: int | None = None,
                  sms: int | None = None) -> BackwardMode:
    """The default plan for a shape: SHORT_KV when max_kv <= SHORT_SIDE (atomic-free as it
    is); else, when ``deterministic``, SHORT_Q_STREAM when max_q <= SHORT_SIDE and TWO_KERNEL
    otherwise (no floating-point atomics). Else, with max_q <= SHORT_SIDE: SHORT_Q_STREAM
    (atomic-free) for 16-bit inputs when max_q <= STREAM_MAX_Q and the batch is known
    (batch, heads, total_kv: the KV rows, sms: the device's SM count) and its items balance
    (stream_balance >= STREAM_MIN_BALANCE), SHORT_Q (dQ by atomics) otherwise; with longer
    Q, ONE_PASS for 16-bit inputs (the op then times it against ONE_PASS_PHASED, see
    one_pass_candidates) and TWO_KERNEL for fp32 ones (whose one-pass tiles would not fit).
    The other modes run only when asked for (GDPAFunction's bwd_mode)."""
    if max_kv <= SHORT_SIDE:
        return BackwardMode.SHORT_KV
    if max_q <= SHORT_SIDE:
        if deterministic:
            return BackwardMode.SHORT_Q_STREAM
        known = None not in (batch, heads, total_kv, sms) and batch > 0
        if dtype.itemsize == 2 and max_q <= STREAM_MAX_Q and known and \
                stream_balance(batch, heads, total_kv, max_kv, sms) >= STREAM_MIN_BALANCE:
            return BackwardMode.SHORT_Q_STREAM
        return BackwardMode.SHORT_Q
    if deterministic:
        return BackwardMode.TWO_KERNEL
    return BackwardMode.ONE_PASS if dtype.itemsize == 2 else BackwardMode.TWO_KERNEL


def one_pass_candidates(max_q: int, max_kv: int, d: int
                        ) -> tuple[tuple[BackwardMode, TileConfig], ...]:
    """(mode, config) plans the op times for the long-KV backward on the first call per shape
    class, the heuristic default first: ONE_PASS and ONE_PASS_PHASED with the default config
    (dQ computed transposed), with 4 stages, and with dQ as the dS K product. All give the
    same gradients up to the atomics' rounding. Why these: gdpa/DESIGN.md."""
    cfg = _one_pass_config(max_q, max_kv, d)
    s4 = replace(cfg, num_stages=4)
    mma_sync = replace(cfg, dq_transposed=False)
    one, phased = BackwardMode.ONE_PASS, BackwardMode.ONE_PASS_PHASED
    return ((one, cfg), (phased, cfg), (one, s4), (phased, s4), (one, mma_sync),
            (phased, mma_sync))


def backward_requests(mode: BackwardMode, cfg: TileConfig | None, cfg_q: TileConfig | None,
                      q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q: int,
                      max_kv: int, d: int
                      ) -> tuple[TileConfig, TileConfig | None, list[ScheduleRequest]]:
    """(config, dQ config, schedules asked for) of one backward plan (backward_plan)."""
    def sched(rows, cols, c, cover=False, blocks="all"):
        return ScheduleRequest(rows, cols, c, cover, blocks)

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"{mode.value} backward needs {what}")

    if mode is BackwardMode.SHORT_KV:
        cfg = cfg or _short_kv_stream_config(max_kv, d)
        need(max_kv <= cfg.block_rows, f"max_kv <= {cfg.block_rows}")
        return cfg, None, [sched(kv_offsets, q_offsets, cfg, cover=True)]
    if mode is BackwardMode.SHORT_KV_ATOMIC:
        cfg = cfg_q or _short_kv_config(max_kv, d)
        need(max_kv <= cfg.block_cols, f"max_kv <= {cfg.block_cols}")
        return cfg, None, [sched(q_offsets, kv_offsets, cfg)]
    if mode is BackwardMode.SHORT_Q:
        cfg = cfg or _short_q_config(max_q, d)
        need(max_q <= cfg.block_cols, f"max_q <= {cfg.block_cols}")
        return cfg, None, [sched(kv_offsets, q_offsets, cfg)]
    if mode is BackwardMode.SHORT_Q_STREAM:
        cfg = cfg or _short_q_stream_config(max_q, d)
        need(max_q <= cfg.block_rows, f"max_q <= {cfg.block_rows}")
        return cfg, None, [sched(q_offsets, kv_offsets, cfg, cover=True)]
    if mode is BackwardMode.ONE_PASS:
        cfg = cfg or _one_pass_config(max_q, max_kv, d)
        return cfg, None, [sched(kv_offsets, q_offsets, cfg)]
    if mode in (BackwardMode.ONE_PASS_PHASED, BackwardMode.ONE_PASS_PHASED_HOISTED):
        cfg = cfg or _one_pass_config(max_q, max_kv, d)
        return cfg, None, [sched(kv_offsets, q_offsets, cfg, cover=(b == "first"), blocks=b)
                           for b in ("first", "middle", "last")]
    cfg = cfg or _dkdv_config(max_q, max_kv, d)
    cfg_q = cfg_q or _dq_config(max_q, max_kv, d)
    return cfg, cfg_q, [sched(kv_offsets, q_offsets, cfg), sched(q_offsets, kv_offsets, cfg_q)]


def backward_plan(mode: BackwardMode, cfg: TileConfig | None, cfg_q: TileConfig | None,
                  q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q: int, max_kv: int,
                  d: int, heads: int, device: torch.device
                  ) -> tuple[TileConfig, TileConfig | None, list[Schedule]]:
    """(config, dQ config, schedules) one backward plan launches with: run_backward's; the
    forward (plan_call) asks for the same schedules early, so that the backward builds none."""
    cfg, cfg_q, reqs = backward_requests(mode, cfg, cfg_q, q_offsets, kv_offsets, max_q,
                                         max_kv, d)
    return cfg, cfg_q, schedules_for(reqs, heads, device)


def run_backward(mode: BackwardMode | str, cfg: TileConfig | None, cfg_q: TileConfig | None,
                 q, k, v, do, q_offsets, kv_offsets, max_q, max_kv, act, norm_code, scale):
    """(dq, dk, dv) by one backward plan; cfg / cfg_q None: the heuristic configs (cfg
    configures the kernel over key blocks, or the fused kernel of SHORT_KV, SHORT_Q and
    SHORT_Q_STREAM; cfg_q the dQ kernel of TWO_KERNEL and the fused kernel of
    SHORT_KV_ATOMIC)."""
    mode = _backward_mode(mode)
    cfg, cfg_q, scheds = backward_plan(mode, cfg, cfg_q, q_offsets, kv_offsets, max_q, max_kv,
                                       q.shape[-1], q.shape[1], q.device)
    tail = (act, norm_code, scale, max_kv)
    launch = {BackwardMode.SHORT_KV: launch_bwd_short_kv_stream,
              BackwardMode.SHORT_KV_ATOMIC: launch_bwd_short_kv,
              BackwardMode.SHORT_Q: launch_bwd_short_q,
              BackwardMode.SHORT_Q_STREAM: launch_bwd_short_q_stream,
              BackwardMode.ONE_PASS: launch_bwd_one_pass}.get(mode)
    if launch is not None:
        return launch(q, k, v, do, scheds[0], cfg, *tail)
    if mode is BackwardMode.TWO_KERNEL:
        return launch_bwd(q, k, v, do, scheds[0], cfg, scheds[1], cfg_q, *tail)
    return launch_bwd_one_pass_phased(q, k, v, do, scheds, cfg, *tail,
                                      hoisted=mode is BackwardMode.ONE_PASS_PHASED_HOISTED)


def _backward_mode(mode: BackwardMode | str) -> BackwardMode:
    try:
        return BackwardMode(mode)
    except ValueError:
        raise ValueError(f"unknown GDPA backward mode {mode!r}; one of "
                         f"{[m.value for m in BackwardMode]}") from None


def _one_pass_key(q: torch.Tensor, max_q: int, max_kv: int, activation: str) -> tuple:
    """The tuner's key for the long-KV backward's choice (one per shape class)."""
    return ("one_pass", length_bucket(max_q), length_bucket(max_kv), q.shape[-1], q.dtype,
            activation, q.device)


def _prebuild_requests(mode: BackwardMode, dkdv_cfg, dq_cfg, tune: bool, q: torch.Tensor,
                       q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q: int,
                       max_kv: int, activation: str) -> list[ScheduleRequest]:
    """The schedules the backward will ask for, built by the forward (plan_call, with its
    own): built in the backward, a miss would stall the host between backward kernels. The
    backward finds them by the saved offsets, which ctx.saved_tensors returns as the same
    objects. A tuned plan not chosen yet is left to the tuning call."""
    if tune and mode is BackwardMode.ONE_PASS:
        candidates = one_pass_candidates(max_q, max_kv, q.shape[-1])
        rec = TUNER.records.get(_one_pass_key(q, max_q, max_kv, activation))
        if rec is not None:
            mode, dkdv_cfg = rec.choice
        elif tuning_enabled(q.device):
            return []  # the first backward of the shape class times (and builds) every plan
        else:
            mode, dkdv_cfg = candidates[0]  # what TUNER.pick runs untuned
    return backward_requests(mode, dkdv_cfg, dq_cfg, q_offsets, kv_offsets, max_q, max_kv,
                             q.shape[-1])[2]


def _call_mode(q: torch.Tensor, k: torch.Tensor, q_offsets: torch.Tensor, max_q: int,
               max_kv: int, bwd_mode, deterministic: bool) -> BackwardMode:
    """The backward plan of a call: the heuristic's (backward_mode) or the one asked for."""
    if bwd_mode is None:
        return backward_mode(max_q, max_kv, q.dtype, deterministic,
                             batch=q_offsets.numel() - 1, heads=q.shape[1],
                             total_kv=k.shape[0], sms=num_sms(q.device))
    mode = _backward_mode(bwd_mode)
    if deterministic and not mode.deterministic:
        raise ValueError(f"GDPA backward mode {mode.value!r} sums with fp32 atomics and "
                         "is not deterministic; leave bwd_mode None or pick one of "
                         f"{[m.value for m in BackwardMode if m.deterministic]}")
    return mode


def plan_call(q, k, q_offsets, kv_offsets, max_q, max_kv, activation, fwd_cfg=None,
              dkdv_cfg=None, dq_cfg=None, bwd_mode=None, deterministic=False,
              needs_grad=True):
    """GDPAFunction.forward's host work: (q_offsets, kv_offsets on q's device, forward
    config, forward schedule, backward plan). The forward's schedule and, when ``needs_grad``,
    the backward's are built in one go (schedules_for: one upload for all of them)."""
    q_offsets = _as_offsets(q_offsets, q.device)
    kv_offsets = _as_offsets(kv_offsets, q.device)
    fwd_cfg = fwd_cfg or _fwd_config(max_q, max_kv, q.shape[-1])
    mode = _call_mode(q, k, q_offsets, max_q, max_kv, bwd_mode, deterministic)
    reqs = [forward_request(q_offsets, kv_offsets, fwd_cfg, max_kv)]
    if needs_grad:
        tune = bwd_mode is None and dkdv_cfg is None
        reqs += _prebuild_requests(mode, dkdv_cfg, dq_cfg, tune, q, q_offsets, kv_offsets,
                                   max_q, max_kv, activation)
    sched = schedules_for(reqs, q.shape[1], q.device)[0]
    return q_offsets, kv_offsets, fwd_cfg, sched, mode


class GDPAFunction(torch.autograd.Function):
    """The Triton forward and backward as one autograd node. Configs and bwd_mode default to
    the heuristics (benchmarks and tests override them; see run_backward for which config
    goes to which kernel). ``deterministic``: the default plan is one without floating-point
    atomics (backward_mode); an explicit bwd_mode that has atomics is then refused."""

    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation, scale,
                norm_code, fwd_cfg=None, dkdv_cfg=None, dq_cfg=None, bwd_mode=None,
                deterministic=False):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        q_offsets, kv_offsets, cfg, sched, mode = plan_call(
            q, k, q_offsets, kv_offsets, max_q, max_kv, activation, fwd_cfg, dkdv_cfg, dq_cfg,
            bwd_mode, deterministic, any(ctx.needs_input_grad[:3]))
        out = launch_fwd(q, k, v, sched, cfg, ACT_CODE[activation], norm_code, scale, max_kv)
        ctx.save_for_backward(q, k, v, q_offsets, kv_offsets)
        tune = bwd_mode is None and dkdv_cfg is None
        ctx.meta = (max_q, max_kv, activation, scale, norm_code, dkdv_cfg, dq_cfg, tune)
        ctx.mode = mode  # the plan the backward runs (ONE_PASS: or a tuned one-pass variant)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, q_offsets, kv_offsets = ctx.saved_tensors
        max_q, max_kv, activation, scale, norm_code, dkdv_cfg, dq_cfg, tune = ctx.meta
        mode = ctx.mode
        act, do = ACT_CODE[activation], do.contiguous()
        args = (q, k, v, do, q_offsets, kv_offsets, max_q, max_kv, act, norm_code, scale)
        if tune and mode is BackwardMode.ONE_PASS:
            d = q.shape[-1]
            mode, dkdv_cfg = TUNER.pick(
                _one_pass_key(q, max_q, max_kv, activation),
                one_pass_candidates(max_q, max_kv, d),
                lambda c: run_backward(c[0], c[1], None, *args), q.device)
        dq, dk, dv = run_backward(mode, dkdv_cfg, dq_cfg, *args)
        return (dq, dk, dv) + (None,) * 12


def triton_unsupported(q: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot take ``q`` (they take fp16/bf16/fp32 and a power-of-two
    head_dim in [16, 256]), or None when they can."""
    d = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"takes fp16/bf16/fp32 inputs, not {q.dtype}"
    if not (16 <= d <= 256 and d & (d - 1) == 0):
        return f"takes a power-of-two head_dim in [16, 256], not {d}"
    return None


def gdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
         kv_offsets: torch.Tensor, max_q: int, max_kv: int, *, activation: str = "silu",
         scale: float | None = None, norm: str = "none",
         kernel: Kernel | str | None = None, deterministic: bool | None = None
         ) -> torch.Tensor:
    """Generalized dot-product attention on jagged Q and jagged KV, no softmax.

    out_i = sum over the KV rows j of i's sample of act(scale * q_i . k_j) * v_j, optionally
    divided by the sample's KV length (norm="kv_len"; 0 rows -> 0) or by max_kv
    (norm="max_len"). q: (total_q, H, d); k, v: (total_kv, H, d); q_offsets, kv_offsets:
    int64 (B+1,); max_q / max_kv >= the longest Q / KV sample. activation: "silu", "gelu",
    "gelu_tanh" or "identity" (the Triton path evaluates gelu_tanh by a polynomial, see
    activations.py). scale defaults to 1/sqrt(d). kernel: None/'auto' (Triton on CUDA,
    reference elsewhere), 'triton' or 'pytorch'. deterministic: the Triton backward uses no
    floating-point atomics, so repeated calls give bitwise-identical gradients; None follows
    gem_kernels.dispatch.deterministic_backward(). Returns (total_q, H, d) in the operands'
    common dtype (autocast's inside an autocast region).
    """
    q, k, v = same_dtype(q, k, v)
    check_inputs(q, k, v, q_offsets, kv_offsets, activation, norm)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    which = resolve_kernel(kernel, q, k, v, unsupported=triton_unsupported(q), op="gdpa")
    if which is Kernel.PYTORCH:
        return gdpa_reference(q, k, v, q_offsets, kv_offsets, max_q, max_kv,
                              activation=activation, scale=scale, norm=norm)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                         or v.requires_grad)):
        return gdpa_forward(q, k, v, q_offsets, kv_offsets, int(max_q), int(max_kv),
                            activation, float(scale), _NORM_CODE[norm])
    return GDPAFunction.apply(q, k, v, q_offsets, kv_offsets, int(max_q), int(max_kv),
                              activation, float(scale), _NORM_CODE[norm], None, None, None,
                              None, deterministic_backward(deterministic))


def gdpa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                 kv_offsets: torch.Tensor, max_q: int, max_kv: int, activation: str,
                 scale: float, norm_code: int, cfg: TileConfig | None = None) -> torch.Tensor:
    """The Triton forward alone (no autograd node): GDPAFunction's forward, and inference and
    no-grad calls, which skip the autograd Function's host overhead."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_offsets = _as_offsets(q_offsets, q.device)
    kv_offsets = _as_offsets(kv_offsets, q.device)
    cfg = cfg or _fwd_config(max_q, max_kv, q.shape[-1])
    sched = forward_schedule(q_offsets, kv_offsets, q.shape[1], cfg, max_kv, q.device)
    return launch_fwd(q, k, v, sched, cfg, ACT_CODE[activation], norm_code, scale, max_kv)
