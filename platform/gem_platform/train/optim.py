"""The dense optimizer: AdamW, fused into one kernel per parameter group on CUDA.

torch.optim.AdamW's default on CUDA is the foreach implementation: a dozen multi-tensor
kernels per step, each a pass over every parameter and state. ``fused=True`` does the whole
update in one pass; on CPU the foreach default stays (fused AdamW there is not faster).

With ``train.lr_fan_in_ref`` the parameters are grouped by learning rate: a 2-D weight whose
fan-in (its second dimension, nn.Linear's layout) exceeds the reference trains at
lr x ref / fan-in, everything else at lr.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gem_platform.recipe import TrainConfig


def lr_scale(param: nn.Parameter, fan_in_ref: int | None) -> float:
    """The multiplier of the recipe's lr for ``param``: ref / fan-in for a 2-D weight wider
    than the reference, 1 otherwise (biases, norms, narrow layers, no reference)."""
    if fan_in_ref is None or param.dim() != 2 or param.shape[1] <= fan_in_ref:
        return 1.0
    return fan_in_ref / param.shape[1]


def param_groups(params: list[nn.Parameter], cfg: TrainConfig) -> list[dict[str, Any]]:
    """One AdamW group per learning rate, in the order each rate first appears (so the
    groups, and a checkpoint's optimizer state, are the same on every rank and every run)."""
    groups: dict[float, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(lr_scale(p, cfg.lr_fan_in_ref), []).append(p)
    return [{"params": ps, "lr": cfg.lr * scale} for scale, ps in groups.items()]


def dense_optimizer(params: list[nn.Parameter], cfg: TrainConfig,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``params`` with the recipe's lr (per group, see module doc) and weight
    decay; fused on CUDA."""
    fused = device.type == "cuda" and all(p.is_cuda for p in params)
    return torch.optim.AdamW(param_groups(params, cfg), lr=cfg.lr,
                             weight_decay=cfg.weight_decay, fused=True if fused else None)
