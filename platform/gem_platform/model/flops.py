"""Useful FLOPs on real jagged lengths: every Linear's rows (real tokens only, since nothing is
padded) and every attention call's real (query, key) pairs.

A meter is active inside ``with FlopMeter(model) as m:``; the attention dispatch reports to it.
"""

from __future__ import annotations

import contextvars

import torch
from torch import nn

_ACTIVE: contextvars.ContextVar[FlopMeter | None] = contextvars.ContextVar("flop_meter",
                                                                          default=None)

# Training FLOPs = forward x 3 (backward computes input and weight gradients: 2x forward).
TRAIN_FLOPS_PER_FORWARD = 3.0


class FlopMeter:
    """Counts forward FLOPs of Linear layers and attention while active."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.linear_flops = 0.0
        self.attention_flops = 0.0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._token: contextvars.Token | None = None

    @property
    def forward_flops(self) -> float:
        return self.linear_flops + self.attention_flops

    @property
    def train_flops(self) -> float:
        return TRAIN_FLOPS_PER_FORWARD * self.forward_flops

    def _on_linear(self, module: nn.Linear, inputs: tuple[torch.Tensor, ...], _out: object
                   ) -> None:
        rows = inputs[0].numel() // module.in_features
        self.linear_flops += 2.0 * rows * module.in_features * module.out_features

    def add_attention(self, pairs: float, heads: int, head_dim: int) -> None:
        """Two matmuls (scores and weighted values) over the real (query, key) pairs."""
        self.attention_flops += 4.0 * pairs * heads * head_dim

    def reset(self) -> None:
        self.linear_flops = 0.0
        self.attention_flops = 0.0

    def __enter__(self) -> FlopMeter:
        for m in self.model.modules():
            if isinstance(m, nn.Linear):
                self._handles.append(m.register_forward_hook(self._on_linear))
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None


def record_attention(pairs: float, heads: int, head_dim: int) -> None:
    meter = _ACTIVE.get()
    if meter is not None:
        meter.add_attention(pairs, heads, head_dim)


def self_attention_pairs(lengths: torch.Tensor, kind: str, window: int, causal: bool) -> float:
    """Real (query, key) pairs of one self-attention call over sequences of these lengths."""
    n = lengths.to(torch.float64)
    if kind in ("full", "padded"):
        return float((n * (n + 1) / 2).sum() if causal else (n * n).sum())
    if kind == "sliding":
        # Each query i sees keys max(0, i-window)..i (causal) or ..i+window (two-sided).
        w = float(window)
        left = torch.where(n > w, (w + 1) * n - w * (w + 1) / 2, n * (n + 1) / 2)
        if causal:
            return float(left.sum())
        return float((2 * left - n).sum())
    if kind == "block64":
        full, rest = torch.div(n, 64, rounding_mode="floor"), torch.remainder(n, 64)
        return float((full * 64 * 64 + rest * rest).sum())
    raise ValueError(f"unknown attention kind {kind!r}")
