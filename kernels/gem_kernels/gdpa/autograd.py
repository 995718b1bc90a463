"""autograd.Function tying the Triton forward and backward kernels to their schedules."""

from __future__ import annotations

import os

import torch

from gem_kernels.gdpa.activations import ACT_CODE
from gem_kernels.gdpa.schedule import Schedule, ScheduleCache, build_schedule
from gem_kernels.gdpa.triton_bwd import dkdv_config, dq_config, launch_bwd
from gem_kernels.gdpa.triton_fwd import TileConfig, fwd_config, launch_fwd

_CACHE = ScheduleCache()


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return int(os.environ.get("GEM_GDPA_INTERPRET_PROGRAMS", "3"))


def schedule_for(rows_offsets: torch.Tensor, cols_offsets: torch.Tensor, heads: int,
                 cfg: TileConfig, device: torch.device) -> Schedule:
    """Persistent schedule of (sample, row block, head) items, cached per offsets pair."""
    key = (cfg.block_rows, cfg.block_cols, cfg.ctas_per_sm, heads, str(device))

    def build() -> Schedule:
        return build_schedule(rows_offsets, cols_offsets, cfg.block_rows, cfg.block_cols,
                              heads, num_sms(device) * cfg.ctas_per_sm, device)

    return _CACHE.get(key, rows_offsets, cols_offsets, build)


class GDPAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation, scale,
                norm_code, fwd_cfg=None, dkdv_cfg=None, dq_cfg=None):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        q_offsets = q_offsets.to(q.device, torch.int64)
        kv_offsets = kv_offsets.to(q.device, torch.int64)
        d, heads = q.shape[-1], q.shape[1]
        cfg = fwd_cfg or fwd_config(max_q, max_kv, d)
        sched = schedule_for(q_offsets, kv_offsets, heads, cfg, q.device)
        out = launch_fwd(q, k, v, sched, cfg, ACT_CODE[activation],
                         norm_code, scale, max_kv)
        ctx.save_for_backward(q, k, v, q_offsets, kv_offsets)
        ctx.meta = (max_q, max_kv, activation, scale, norm_code, dkdv_cfg, dq_cfg)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, q_offsets, kv_offsets = ctx.saved_tensors
        max_q, max_kv, activation, scale, norm_code, dkdv_cfg, dq_cfg = ctx.meta
        d, heads = q.shape[-1], q.shape[1]
        cfg_kv = dkdv_cfg or dkdv_config(max_q, max_kv, d)
        cfg_q = dq_cfg or dq_config(max_q, max_kv, d)
        sched_kv = schedule_for(kv_offsets, q_offsets, heads, cfg_kv, q.device)
        sched_q = schedule_for(q_offsets, kv_offsets, heads, cfg_q, q.device)
        dq, dk, dv = launch_bwd(q, k, v, do.contiguous(), sched_kv,
                                cfg_kv, sched_q, cfg_q, ACT_CODE[activation], norm_code,
                                scale, max_kv)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None
