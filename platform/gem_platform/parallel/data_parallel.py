"""Replicated (data-parallel) parameters: start equal, average gradients each step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def all_reduce_gradients(params: list[nn.Parameter], world_size: int) -> None:
    """Average gradients over ranks in one flat bucket (one collective per step)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or world_size == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def broadcast_parameters(model: nn.Module) -> None:
    """Start every rank from rank 0's weights."""
    if dist.is_available() and dist.is_initialized():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
