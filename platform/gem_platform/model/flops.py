"""Useful FLOPs on real jagged lengths: every Linear's rows (real tokens only, since nothing is
padded) and every attention call's real (query, key) pairs.

A meter is active inside ``with FlopMeter(model) as m:``. Linear layers are counted by forward
hooks, except inside a *counted region*: a module with a ``forward_flops(meter, inputs)``
method, or one marked with ``count_by_rows`` (all its Linear layers see as many rows as its
first input). A region is counted once per call by one hook on itself, outside whatever runs
inside it: a compiled region's graph holds no hooks, and a region that recomputes its forward
in the backward (activation checkpointing) is not counted twice. The attention pairs of the
self-attention blocks need the histories' lengths on the host: the loop hands them over
(``seq_lengths``) so that counting never waits on the GPU.
"""

from __future__ import annotations

import contextvars

import torch
from torch import nn

_ACTIVE: contextvars.ContextVar[FlopMeter | None] = contextvars.ContextVar("flop_meter",
                                                                          default=None)

# Training FLOPs = forward x 3 (backward computes input and weight gradients: 2x forward).
TRAIN_FLOPS_PER_FORWARD = 3.0
COUNT_BY_ROWS = "_gem_count_by_rows"


def count_by_rows(module: nn.Module) -> nn.Module:
    """Mark ``module`` as a counted region whose Linear layers all see as many rows as its
    first input has (a DHEN layer, the head); returns it."""
    setattr(module, COUNT_BY_ROWS, True)
    return module


def is_counted_region(module: nn.Module) -> bool:
    return hasattr(module, "forward_flops") or getattr(module, COUNT_BY_ROWS, False)


def linear_flops_per_row(module: nn.Module) -> float:
    """Forward FLOPs of one row through every Linear layer inside ``module``."""
    return sum(2.0 * m.in_features * m.out_features for m in module.modules()
               if isinstance(m, nn.Linear))


class FlopMeter:
    """Counts forward FLOPs of Linear layers and attention while active."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.linear_flops = 0.0
        self.attention_flops = 0.0
        # Host copy of the batch's history lengths, set by the caller before the forward.
        self.seq_lengths: torch.Tensor | None = None
        self._per_row: dict[int, float] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._token: contextvars.Token | None = None

    @property
    def forward_flops(self) -> float:
        return self.linear_flops + self.attention_flops

    @property
    def train_flops(self) -> float:
        return TRAIN_FLOPS_PER_FORWARD * self.forward_flops

    def host_lengths(self, offsets: torch.Tensor) -> torch.Tensor:
        """The lengths behind ``offsets``: the host copy when one was set for this batch, else
        read from ``offsets`` (a device sync on GPU)."""
        if self.seq_lengths is not None and self.seq_lengths.numel() == offsets.numel() - 1:
            return self.seq_lengths
        return (offsets[1:] - offsets[:-1]).cpu()

    def add_linear_rows(self, rows: int, module: nn.Module) -> None:
        """``rows`` rows through every Linear layer of ``module``."""
        key = id(module)
        if key not in self._per_row:
            self._per_row[key] = linear_flops_per_row(module)
        self.linear_flops += rows * self._per_row[key]

    def _on_linear(self, module: nn.Linear, inputs: tuple[torch.Tensor, ...], _out: object
                   ) -> None:
        rows = inputs[0].numel() // module.in_features
        self.linear_flops += 2.0 * rows * module.in_features * module.out_features

    def _on_region(self, module: nn.Module, inputs: tuple, _out: object) -> None:
        if hasattr(module, "forward_flops"):
            module.forward_flops(self, inputs)
        else:
            self.add_linear_rows(int(inputs[0].shape[0]), module)

    def add_attention(self, pairs: float, heads: int, head_dim: int) -> None:
        """Two matmuls (scores and weighted values) over the real (query, key) pairs."""
        self.attention_flops += 4.0 * pairs * heads * head_dim

    def reset(self) -> None:
        self.linear_flops = 0.0
        self.attention_flops = 0.0
        self.seq_lengths = None

    def _hook(self, module: nn.Module) -> None:
        if is_counted_region(module):
            self._handles.append(module.register_forward_hook(self._on_region))
            return
        if isinstance(module, nn.Linear):
            self._handles.append(module.register_forward_hook(self._on_linear))
        for child in module.children():
            self._hook(child)

    def __enter__(self) -> FlopMeter:
        self._hook(self.model)
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
