"""Sequence tower: jagged behaviour-history tokens through self-attention blocks."""

from __future__ import annotations

import torch
from torch import nn

from gem_platform.model.attention import SelfAttentionSpec, self_attention
from gem_platform.model.flops import FlopMeter, self_attention_pairs


class RMSNorm(nn.Module):
    """Per-head RMS normalization of q and k (QK-norm): bounds attention scores."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))


class SelfAttentionBlock(nn.Module):
    """Pre-norm transformer block on (T, d) jagged tokens; no padding anywhere."""

    def __init__(self, dim: int, heads: int, spec: SelfAttentionSpec, qk_norm: bool) -> None:
        super().__init__()
        self.heads, self.head_dim, self.spec = heads, dim // heads, spec
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, self.head_dim).unbind(1)
        # QK-norm's fp32 weight would promote q and k past autocast's dtype: one dtype for the op
        q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        attn = self_attention(q, k, v, offsets, max_len, self.spec)
        x = x + self.out(attn.reshape(t, self.heads * self.head_dim))  # t may be 0
        return x + self.ffn(self.norm2(x))

    def forward_flops(self, meter: FlopMeter, inputs: tuple) -> None:
        """Useful forward FLOPs of one call (a counted region): every Linear over the T tokens,
        attention over the real (query, key) pairs of the spec."""
        x, offsets = inputs[0], inputs[1]
        meter.add_linear_rows(x.shape[0], self)
        pairs = self_attention_pairs(meter.host_lengths(offsets), self.spec.kind,
                                     self.spec.window, self.spec.causal)
        meter.add_attention(pairs, self.heads, self.head_dim)


class SequenceTower(nn.Module):
    def __init__(self, dim: int, heads: int, layers: int, spec: SelfAttentionSpec,
                 qk_norm: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            SelfAttentionBlock(dim, heads, spec, qk_norm) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, offsets, max_len)
        return self.norm(x)
