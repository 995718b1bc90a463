"""The dense optimizer: AdamW, fused into one kernel per parameter group on CUDA.

torch.optim.AdamW's default on CUDA is the foreach implementation: a dozen multi-tensor
kernels per step, each a pass over every parameter and state. ``fused=True`` does the whole
update in one pass; on CPU the foreach default stays (fused AdamW there is not faster).
"""

from __future__ import annotations

import torch
from torch import nn

from gem_platform.recipe import TrainConfig


def dense_optimizer(params: list[nn.Parameter], cfg: TrainConfig,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``params`` with the recipe's lr and weight decay; fused on CUDA."""
    fused = device.type == "cuda" and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                             fused=True if fused else None)
