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
    """Pre-norm transformer block on (T, d) jagged tokens; no padding anywhere.

    With ``expose_attention`` it returns ``(x, update)``: its output and what its attention
    added to each token (the ``out`` projection, before the residual add). A region is
    compiled and recomputed as a whole, so that read of the history leaves it as an output.

    With ``side_qk`` queries and keys come from a side input of each event (its category
    row), values from the token itself: attention finds events by what they are, not through
    the sum of everything the token carries (side information kept out of the values, as in
    NOVA's non-invasive fusion).

    With ``shared_qk`` one projection gives both queries and keys (the Reformer's shared-QK
    attention): an event's score against another starts as the similarity of their inputs,
    so attention finds events like the querying one from the first step instead of after
    two projections have learned to agree."""

    def __init__(self, dim: int, heads: int, spec: SelfAttentionSpec, qk_norm: bool,
                 expose_attention: bool = False, side_qk: bool = False,
                 shared_qk: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.spec = heads, dim // heads, spec
        self.expose_attention, self.side_qk, self.shared_qk = expose_attention, side_qk, shared_qk
        self.norm1 = nn.LayerNorm(dim)
        qk_width = dim if shared_qk else 2 * dim
        if side_qk:
            self.side_norm = nn.LayerNorm(dim)
            self.qk = nn.Linear(dim, qk_width)
            self.v = nn.Linear(dim, dim)
        else:
            self.qkv = nn.Linear(dim, qk_width + dim)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, 4 * dim)

    def _qkv(self, x: torch.Tensor, side: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, H, head_dim) queries, keys and values."""
        t, shape = x.shape[0], (x.shape[0], self.heads, self.head_dim)
        if not self.side_qk:
            parts = self.qkv(self.norm1(x)).view(t, 3 - self.shared_qk, *shape[1:]).unbind(1)
            return (parts[0], parts[0], parts[1]) if self.shared_qk else parts
        if side is None:
            raise ValueError("this block takes queries and keys from a side input "
                             "(model.attention_qk=category): pass it")
        qk = self.qk(self.side_norm(side)).view(t, 2 - self.shared_qk, *shape[1:]).unbind(1)
        return qk[0], qk[-1], self.v(self.norm1(x)).view(shape)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int,
                side: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``side`` (T, d): what queries and keys are computed from, with ``side_qk``."""
        t = x.shape[0]
        q, k, v = self._qkv(x, side)
        # QK-norm's fp32 weight would promote q and k past autocast's dtype: one dtype for the op
        q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        attn = self_attention(q, k, v, offsets, max_len, self.spec)
        update = self.out(attn.reshape(t, self.heads * self.head_dim))  # t may be 0
        x = x + update
        x = x + self.ffn(self.norm2(x))
        return (x, update) if self.expose_attention else x

    def forward_flops(self, meter: FlopMeter, inputs: tuple) -> None:
        """Useful forward FLOPs of one call (a counted region): every Linear over the T tokens,
        attention over the real (query, key) pairs of the spec."""
        x, offsets = inputs[0], inputs[1]
        meter.add_linear_rows(x.shape[0], self)
        pairs = self_attention_pairs(meter.host_lengths(offsets), self.spec.kind,
                                     self.spec.window, self.spec.causal)
        meter.add_attention(pairs, self.heads, self.head_dim)


class SequenceTower(nn.Module):
    """Self-attention blocks and a final LayerNorm. With ``expose_attention`` the last block
    also hands out its attention update (``forward_with_attention``)."""

    def __init__(self, dim: int, heads: int, layers: int, spec: SelfAttentionSpec,
                 qk_norm: bool, expose_attention: bool = False, side_qk: bool = False,
                 shared_qk: bool = False) -> None:
        super().__init__()
        if expose_attention and layers < 1:
            raise ValueError("exposing the last block's attention needs at least one block")
        self.blocks = nn.ModuleList(
            SelfAttentionBlock(dim, heads, spec, qk_norm,
                               expose_attention=expose_attention and i == layers - 1,
                               side_qk=side_qk, shared_qk=shared_qk)
            for i in range(layers)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int,
                side: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_with_attention(x, offsets, max_len, side)[0]

    def forward_with_attention(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int,
                               side: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(T, d) normalized output, and the last block's attention update (T, d): what its
        attention read from the history for each token, before the residual stream and the
        norms scale it back (None unless built with ``expose_attention``). ``side``: every
        block's query and key input, for blocks built with ``side_qk``."""
        update = None
        for block in self.blocks:
            out = block(x, offsets, max_len) if side is None else block(x, offsets, max_len, side)
            x, update = out if isinstance(out, tuple) else (out, None)
        return self.norm(x), update
