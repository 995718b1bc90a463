"""The one attention dispatch of the model: recipe choice -> gem_kernels op.

Each gem_kernels op picks its Triton kernel on CUDA and its PyTorch reference elsewhere; the
``padded`` kind is the dense baseline (pad to the batch max, mask, SDPA) that the jagged
kernels are measured against in ablations. A ``kernel`` other than auto, triton or pytorch
names a model variant (gem_platform.model_variants), which computes the attention instead:
``baseline``, gem_bench's off-the-shelf parts, is the e2e benchmark's same-run baseline.

RoPE (``rope_base``): block attention rotates q and k inside its kernel; for the other kinds
q and k are rotated here, before the op, by gem_kernels' RoPE reference (the same convention
and tables: positions restart at 0 in every sequence), so full, sliding and padded attention
see exact relative distances too. A model variant gets them rotated too, for every kind but
block64, whose RoPE stays the variant's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gem_kernels import custom_ops
from gem_kernels.block_attention import (
    RopeConfig,
    apply_rope_reference,
    block_attention,
    rope_tables_for,
    sequence_positions,
)
from gem_kernels.gdpa import gdpa
from gem_kernels.jagged_attention import jagged_attention
from gem_platform import model_variants


@dataclass(frozen=True)
class SelfAttentionSpec:
    kind: str  # full | sliding | block64 | padded
    window: int = 64
    causal: bool = False
    rope_base: float | None = None
    kernel: str = "auto"


def _padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                      max_len: int, causal: bool) -> torch.Tensor:
    """Dense baseline: scatter into (B, H, max_len, d), masked SDPA, gather real rows back."""
    lengths = offsets[1:] - offsets[:-1]
    b, h, d = lengths.numel(), q.shape[1], q.shape[2]
    if q.shape[0] == 0 or max_len == 0:
        return torch.zeros_like(q)
    seq_idx = torch.repeat_interleave(torch.arange(b, device=q.device), lengths)
    pos = torch.arange(q.shape[0], device=q.device) - offsets[:-1][seq_idx]

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(b, max_len, h, d)
        out[seq_idx, pos] = x
        return out.transpose(1, 2)

    valid = torch.arange(max_len, device=q.device)[None, :] < lengths[:, None]  # (B, L)
    mask = valid[:, None, None, :]
    if causal:
        tri = torch.ones(max_len, max_len, dtype=torch.bool, device=q.device).tril()
        mask = mask & tri
    # Rows with no valid key (padding rows) would be NaN under softmax; give them key 0.
    mask = mask | (~mask.any(-1, keepdim=True) & (torch.arange(max_len, device=q.device) == 0))
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask)
    return out.transpose(1, 2)[seq_idx, pos]


def _rotated(q: torch.Tensor, k: torch.Tensor, offsets: torch.Tensor, max_len: int,
             base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by each token's position in its own sequence (RoPE), in their dtype."""
    positions = sequence_positions(offsets, q.shape[0])
    tables = rope_tables_for(RopeConfig(base=base), max(max_len, 1), q.shape[-1], q.device)
    return (apply_rope_reference(q, positions, tables).to(q.dtype),
            apply_rope_reference(k, positions, tables).to(k.dtype))


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                   max_len: int, spec: SelfAttentionSpec) -> torch.Tensor:
    """Self-attention over jagged sequences: q/k/v (T, H, d), offsets (B+1,) -> (T, H, d).

    Inside torch.compile the ops go through their custom-op form (gem_kernels.custom_ops), one
    opaque node each; eager calls take the public ops directly. Its FLOPs are counted by the
    calling block (SelfAttentionBlock.forward_flops), not here: counting needs the lengths on
    the host, which a compiled region must not sync for."""
    if spec.rope_base is not None and spec.kind != "block64":
        q, k = _rotated(q, k, offsets, max_len, spec.rope_base)
    if spec.kernel not in model_variants.KERNELS and spec.kind != "padded":
        return model_variants.get(spec.kernel).self_attention(q, k, v, offsets, max_len, spec)
    compiling = torch.compiler.is_compiling()
    if spec.kind in ("full", "sliding"):
        window = None
        if spec.kind == "sliding":
            window = (spec.window, 0 if spec.causal else spec.window)
        if compiling:
            return custom_ops.jagged_attention(q, k, v, offsets, max_len, causal=spec.causal,
                                               window=window, kernel=spec.kernel)
        return jagged_attention(q, k, v, offsets, max_len, causal=spec.causal, window=window,
                                kernel=spec.kernel)
    if spec.kind == "block64":
        if compiling:
            return custom_ops.block_attention(q, k, v, offsets, block=64,
                                              rope_base=spec.rope_base, kernel=spec.kernel)
        rope = None if spec.rope_base is None else RopeConfig(base=spec.rope_base)
        return block_attention(q, k, v, offsets, block=64, rope=rope, kernel=spec.kernel)
    if spec.kind == "padded":
        return _padded_attention(q, k, v, offsets, max_len, spec.causal)
    raise ValueError(f"unknown attention kind {spec.kind!r}")


def generalized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q: int,
                          max_kv: int, *, activation: str, norm: str = "none",
                          kernel: str = "auto") -> torch.Tensor:
    """Cross / pooled attention in GDPA form (activation instead of softmax); its callers
    count its (query, key) pairs from their shapes (no device sync)."""
    if kernel not in model_variants.KERNELS:
        return model_variants.get(kernel).generalized_attention(
            q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation=activation, norm=norm)
    return gdpa(q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation=activation, norm=norm,
                kernel=kernel)
