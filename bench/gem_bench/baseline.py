"""The same attention from off-the-shelf parts, the model variant ``baseline``
(``model.kernel: baseline``): the same-run baseline that ``gemctl bench e2e`` measures the
platform's own build against. pyproject.toml declares it in the entry-point group
``gem_platform.model_variants``, so every process of an installed tree, Ray workers included,
finds it by name; importing this module also registers it in this process.

- self-attention: torch.nn.attention.varlen.varlen_attn (FlashAttention on jagged tensors) on
  CUDA where this torch has it; the padded SDPA path elsewhere. Block attention is varlen
  attention over the 64-token blocks (RoPE applied by its PyTorch reference first).
- cross and pooled attention: GDPA's padded PyTorch form (pad to the longest sample, einsum,
  activation, einsum), compiled with torch.compile on CUDA (eager on CPU).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from gem_kernels.block_attention import (
    RopeConfig,
    apply_rope_reference,
    rope_tables_for,
    sequence_positions,
)
from gem_kernels.gdpa.reference import gdpa_padded, pad_jagged, unpad_jagged
from gem_platform.model_variants import register

BLOCK = 64


@functools.cache
def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_available(device: torch.device) -> bool:
    """True when varlen_attn can run here (it is a FlashAttention kernel: CUDA only)."""
    return device.type == "cuda" and _varlen() is not None


def _padded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                 max_len: int, causal: bool, window: tuple[int, int] | None) -> torch.Tensor:
    """Pad to the longest sequence, masked SDPA, real rows back."""
    if q.shape[0] == 0 or max_len == 0:
        return torch.zeros_like(q)
    qp, valid = pad_jagged(q, offsets, max_len)
    kp, _ = pad_jagged(k, offsets, max_len)
    vp, _ = pad_jagged(v, offsets, max_len)
    pos = torch.arange(max_len, device=q.device)
    mask = valid[:, None, None, :]  # (B, 1, 1, L) keys
    rel = pos[None, :] - pos[:, None]  # key - query
    if causal:
        mask = mask & (rel <= 0)
    if window is not None:
        mask = mask & (rel >= -window[0]) & (rel <= window[1])
    # a query with no valid key (padding rows) would be NaN under softmax: give it key 0
    mask = mask | (~mask.any(-1, keepdim=True) & (pos == 0))
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2),
                                         vp.transpose(1, 2), attn_mask=mask)
    return unpad_jagged(out.transpose(1, 2), offsets, q.shape[0])


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                   max_len: int, causal: bool, window: tuple[int, int] | None) -> torch.Tensor:
    """Softmax attention within each sequence: varlen_attn on CUDA, padded SDPA elsewhere."""
    if not varlen_available(q.device) or q.dtype not in (torch.float16, torch.bfloat16):
        return _padded_sdpa(q, k, v, offsets, max_len, causal, window)
    left = -1 if window is None else window[0]
    right = 0 if causal else (-1 if window is None else window[1])
    cu = offsets.to(torch.int32)
    return _varlen()(q, k, v, cu, cu, max_len, max_len, window_size=(left, right))


def block_offsets(offsets: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, int]:
    """Offsets of every ``block``-token piece of every sequence (cut from its first token),
    and the longest piece."""
    bounds = offsets.tolist()
    cuts = [0]
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        cuts += [*range(s + block, e, block), e] if e > s else []
    out = torch.tensor(cuts, dtype=torch.int64, device=offsets.device)
    longest = max((b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)), default=0)
    return out, longest


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                    rope_base: float | None, causal: bool) -> torch.Tensor:
    """64-token block attention as varlen attention over the blocks, RoPE by its reference."""
    if rope_base is not None and q.shape[0]:
        tables = rope_tables_for(RopeConfig(base=rope_base), int(q.shape[0]), q.shape[-1],
                                 q.device)
        positions = sequence_positions(offsets, q.shape[0])
        q = apply_rope_reference(q, positions, tables).to(v.dtype)
        k = apply_rope_reference(k, positions, tables).to(v.dtype)
    blocks, longest = block_offsets(offsets)
    return self_attention(q, k, v, blocks, longest, causal, None)


def _gdpa_core(qp, kp, vp, kv_valid, kv_len, activation: str, norm: str):
    return gdpa_padded(qp, kp, vp, kv_valid, activation=activation, norm=norm, kv_len=kv_len)


_compiled_core = torch.compile(_gdpa_core, dynamic=True)


def gdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
         kv_offsets: torch.Tensor, max_q: int, max_kv: int, *, activation: str,
         norm: str) -> torch.Tensor:
    """GDPA padded to the longest Q and KV sample; the padded math compiled on CUDA."""
    if q.shape[0] == 0:
        return torch.zeros_like(q)
    qp, _ = pad_jagged(q, q_offsets, max(int(max_q), 1))
    kp, kv_valid = pad_jagged(k, kv_offsets, max(int(max_kv), 1))
    vp, _ = pad_jagged(v, kv_offsets, max(int(max_kv), 1))
    kv_len = kv_offsets[1:] - kv_offsets[:-1]
    core = _compiled_core if q.is_cuda else _gdpa_core
    out = core(qp, kp, vp, kv_valid, kv_len, activation, norm)
    return unpad_jagged(out, q_offsets, q.shape[0])


class OffTheShelf:
    """The ``baseline`` variant: the model's two attention calls through the parts above."""

    def self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       offsets: torch.Tensor, max_len: int, spec) -> torch.Tensor:
        """As gem_platform.model.attention.self_attention for ``spec`` (a SelfAttentionSpec)."""
        if spec.kind == "block64":  # as the block64 op: every key of the block
            return block_attention(q, k, v, offsets, spec.rope_base, causal=False)
        window = None
        if spec.kind == "sliding":
            window = (spec.window, 0 if spec.causal else spec.window)
        return self_attention(q, k, v, offsets, max_len, spec.causal, window)

    def generalized_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q: int,
                              max_kv: int, *, activation: str, norm: str) -> torch.Tensor:
        return gdpa(q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation=activation,
                    norm=norm)


VARIANT = OffTheShelf()
register("baseline", VARIANT)
