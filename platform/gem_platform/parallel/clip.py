"""Gradient-norm clipping over parameters that different strategies hold differently.

``torch.nn.utils.clip_grad_norm_`` needs all gradients on one mesh. Here dense gradients may be
FSDP DTensors on the dense mesh or plain replicas, while expert gradients are DTensors on each
expert's own mesh and differ between the ranks of an expert group. The global norm is the
dense norm plus, summed over the expert group, the norm of the experts each rank holds: the
same number on every rank, so replicas stay equal after clipping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _squared_norm(params: Sequence[nn.Parameter], device: torch.device) -> torch.Tensor:
    """Squared L2 norm of the full (unsharded) gradients of ``params``, all on one mesh or all
    plain tensors, on ``device`` (no host sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm.double().to(device) ** 2


def _by_mesh(params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Group parameters by the mesh they are sharded on (plain tensors form one group)."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        key = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault(id(key) if key is not None else None, []).append(p)
    return list(groups.values())


def clip_grad_norm(dense: Sequence[nn.Parameter], experts: Sequence[nn.Parameter],
                   expert_group: dist.ProcessGroup | None, max_norm: float) -> torch.Tensor:
    """Scale all gradients so that their global L2 norm is at most ``max_norm``; returns the
    norm before clipping. ``experts`` are the expert parameters this rank holds (its expert
    group's other ranks hold the rest); they are excluded from ``dense`` if listed there too."""
    expert_ids = {id(p) for p in experts}
    dense = [p for p in dense if id(p) not in expert_ids]
    device = _device([*dense, *experts])
    total = sum((_squared_norm(g, device) for g in _by_mesh(dense)),
                torch.zeros((), dtype=torch.float64, device=device))
    expert_sq = sum((_squared_norm(g, device) for g in _by_mesh(experts)),
                    torch.zeros((), dtype=torch.float64, device=device))
    if expert_group is not None:
        dist.all_reduce(expert_sq, group=expert_group)
    norm = (total + expert_sq).sqrt()
    if not math.isinf(max_norm):
        # Scaled on the device whatever the norm (by exactly 1 below the limit): reading the
        # norm on the host would stall the launch queue every step.
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in [*dense, *experts]:
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                by_dtype.setdefault(grad.dtype, []).append(grad)
        for dtype, grads in by_dtype.items():  # one multi-tensor launch per dtype
            torch._foreach_mul_(grads, coef.to(dtype))
    return norm.float()


def _device(params: Sequence[nn.Parameter]) -> torch.device:
    """Where the gradients live (the local shard's device for a DTensor); CPU with none."""
    for p in params:
        return p.to_local().device if isinstance(p, DTensor) else p.device
    return torch.device("cpu")
