"""Rotary position embedding (RoPE) for jagged sequences: config, cos/sin tables, reference.

Convention (shared with the Triton kernels): "rotate half" (GPT-NeoX style). For head_dim d and
i < d/2 the pair (x[i], x[i + d/2]) at position p is rotated by the angle p * base^(-2i/d):
    y[i]       = x[i] * cos - x[i + d/2] * sin
    y[i + d/2] = x[i + d/2] * cos + x[i] * sin
Positions restart at 0 at the first token of every sequence. The tables are fp32 with shape
(num_positions, d/2); the kernels read them directly, so they must be contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeConfig:
    """RoPE given by its base; tables are built (and cached) on demand."""

    base: float = 10000.0


@dataclass(frozen=True)
class RopeTables:
    """Precomputed RoPE tables: cos and sin, fp32, (num_positions, head_dim // 2)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __post_init__(self) -> None:
        if self.cos.shape != self.sin.shape or self.cos.dim() != 2:
            raise ValueError("cos and sin must share one (num_positions, head_dim // 2) shape")


Rope = RopeConfig | RopeTables


def build_rope_tables(num_positions: int, head_dim: int, base: float = 10000.0,
                      device: torch.device | str = "cpu") -> RopeTables:
    """cos/sin tables for positions [0, num_positions), computed in fp64 then stored fp32."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim; got {head_dim}")
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / head_dim)
    angle = torch.arange(num_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return RopeTables(cos=angle.cos().float().contiguous().to(device),
                      sin=angle.sin().float().contiguous().to(device))


_TABLE_CACHE: dict[tuple[float, int, str, torch.dtype], RopeTables] = {}


def rope_tables_for(rope: Rope, num_positions: int, head_dim: int, device: torch.device,
                    dtype: torch.dtype = torch.float32) -> RopeTables:
    """Tables covering at least num_positions positions on device, stored in dtype.

    A RopeConfig's tables are cached per (base, head_dim, device, dtype) and grown to the next
    power of two, so steady-state training builds them once. RopeTables are returned as given
    (moved to device and dtype, made contiguous). The kernels read tables in the input dtype:
    they round them to it anyway, and half the bytes is less load traffic per tile.
    """
    if isinstance(rope, RopeTables):
        if rope.cos.shape[1] * 2 != head_dim:
            raise ValueError(f"RoPE tables have {rope.cos.shape[1]} frequencies; head_dim "
                             f"{head_dim} needs {head_dim // 2}")
        return RopeTables(cos=rope.cos.to(device=device, dtype=dtype).contiguous(),
                          sin=rope.sin.to(device=device, dtype=dtype).contiguous())
    if not isinstance(rope, RopeConfig):
        raise TypeError(f"rope must be None, RopeConfig or RopeTables; got {type(rope)}")
    key = (float(rope.base), head_dim, str(device), dtype)
    cached = _TABLE_CACHE.get(key)
    if cached is None or cached.cos.shape[0] < num_positions:
        n = 1 << max(int(num_positions) - 1, 0).bit_length()
        full = build_rope_tables(max(n, 64), head_dim, rope.base, device)
        cached = RopeTables(cos=full.cos.to(dtype), sin=full.sin.to(dtype))
        _TABLE_CACHE[key] = cached
    return cached


def sequence_positions(offsets: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """(total_tokens,) int64 position of every token within its own sequence (no host sync)."""
    t = torch.arange(total_tokens, device=offsets.device, dtype=torch.int64)
    seq = torch.searchsorted(offsets[1:].contiguous(), t, right=True)
    return t - offsets[seq]


def apply_rope_reference(x: torch.Tensor, positions: torch.Tensor,
                         tables: RopeTables) -> torch.Tensor:
    """Rotate x (tokens, H, d) by per-token positions; computed and returned in fp32 (fp64
    for fp64 x)."""
    half = x.shape[-1] // 2
    xf = x.double() if x.dtype == torch.float64 else x.float()
    cos = tables.cos.to(device=x.device, dtype=xf.dtype)[positions][:, None, :]  # (tokens,1,d/2)
    sin = tables.sin.to(device=x.device, dtype=xf.dtype)[positions][:, None, :]
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
