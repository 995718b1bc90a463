"""Helpers shared by kernel tests and benchmarks: jagged offsets from lengths, random lengths."""

from __future__ import annotations

import math

import torch


def offsets_from_lengths(lengths: list[int] | torch.Tensor, device: str | torch.device = "cpu"
                         ) -> torch.Tensor:
    """(B,) lengths -> (B+1,) int64 offsets starting at 0."""
    lengths_t = torch.as_tensor(lengths, dtype=torch.int64)
    out = torch.zeros(lengths_t.numel() + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(lengths_t, 0)
    return out.to(device)


def lognormal_lengths(batch: int, mean: float, max_len: int, min_len: int = 1, sigma: float = 1.0,
                      seed: int = 0) -> list[int]:
    """Long-tailed lengths: log-normal with the given mean, clipped to [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma * sigma / 2
    x = torch.exp(mu + sigma * torch.randn(batch, generator=g, dtype=torch.float64))
    return [int(v) for v in x.round().clamp(min_len, max_len).tolist()]


def powerlaw_lengths(batch: int, alpha: float, max_len: int, min_len: int = 16, seed: int = 0
                     ) -> list[int]:
    """Pareto-tailed lengths in [min_len, max_len] (smaller alpha = heavier tail)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, generator=g, dtype=torch.float64).clamp_min(1e-12)
    x = min_len * u.pow(-1.0 / alpha)
    return [int(v) for v in x.round().clamp(min_len, max_len).tolist()]
