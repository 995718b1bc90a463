"""Pure PyTorch reference for jagged attention: exact, differentiable by autograd, any device.

Semantics (shared with the Triton kernels):
- q, k, v: (total_tokens, heads, head_dim); offsets: int64 (B+1,), sequence b owns rows
  offsets[b]:offsets[b+1]. Attention never crosses sequences.
- scale defaults to 1/sqrt(head_dim).
- causal: query i sees key j only if j <= i (positions within the sequence).
- window=(left, right): query i sees key j only if i-left <= j <= i+right; combined with causal
  when both are given.
- A query row with no valid key outputs 0 (and gets zero gradient).
Scores, softmax and the PV product are computed in fp32 (fp64 for fp64 inputs); the output has
q's dtype.
"""

from __future__ import annotations

import math

import torch


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                 window: tuple[int, int] | None) -> None:
    """Raises ValueError naming the shape or window that the op cannot take."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one (total_tokens, heads, head_dim) shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError("offsets must be a 1-D (B+1,) tensor")
    if window is not None:
        if len(window) != 2 or window[0] < 0 or window[1] < 0:
            raise ValueError(f"window must be (left, right) with both >= 0; got {window}")


def attention_mask(n: int, causal: bool, window: tuple[int, int] | None,
                   device: torch.device | str = "cpu") -> torch.Tensor | None:
    """(n, n) bool mask of allowed (query, key) pairs for one sequence; None = all allowed."""
    if not causal and window is None:
        return None
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    mask = torch.ones(n, n, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    if window is not None:
        left, right = int(window[0]), int(window[1])
        mask &= (j >= i - left) & (j <= i + right)
    return mask


# Sequences of similar length are padded together, this many at a time: a few batched ops per
# group instead of a Python loop per sequence, with little padding (lengths are sorted first).
GROUP_SIZE = 32


def _padded_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                  scale: float, causal: bool, window: tuple[int, int] | None) -> torch.Tensor:
    """q, k, v: (n, L, H, D) zero-padded, lengths (n,) -> (n, L, H, D) in q's dtype."""
    length = q.shape[1]
    s = torch.einsum("nihd,njhd->nhij", q, k) * scale  # (n, H, L, L)
    pos = torch.arange(length, device=q.device)
    mask = (pos[None, :] < lengths[:, None])[:, None, None, :]  # valid keys
    seq_mask = attention_mask(length, causal, window, q.device)
    if seq_mask is not None:
        mask = mask & seq_mask
    s = torch.where(mask, s, torch.full_like(s, float("-inf")))
    # Row max as a constant shift (softmax is invariant to it, so detaching keeps gradients
    # exact); rows with no valid key get shift 0 so that every exp below is exp(-inf) = 0.
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("nhij,njhd->nihd", p, v)
    # Empty rows: p = 0, so o = 0 / tiny = 0 with a finite (zero) gradient.
    return o / denom.clamp_min(torch.finfo(denom.dtype).tiny).permute(0, 2, 1, 3)


def jagged_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               offsets: torch.Tensor, max_len: int | None = None, *,
                               causal: bool = False, window: tuple[int, int] | None = None,
                               scale: float | None = None, kernel: object = None,
                               deterministic: bool = False) -> torch.Tensor:
    """Jagged softmax attention, one sequence at a time. Same signature as ``jagged_attention``
    (``max_len``, ``kernel`` and ``deterministic`` are accepted and ignored)."""
    del max_len, kernel, deterministic
    check_inputs(q, k, v, offsets, window)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    starts = offsets[:-1].to(torch.int64).cpu()
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64).cpu()
    order = [int(b) for b in torch.argsort(lengths, stable=True) if lengths[b] > 0]
    out = q.new_zeros(q.shape, dtype=acc)
    for first in range(0, len(order), GROUP_SIZE):
        group = torch.tensor(order[first : first + GROUP_SIZE])
        glen = lengths[group]
        longest = int(glen.max())
        # (row in group, position) of every real token of the group, and its global index
        member = torch.repeat_interleave(torch.arange(len(group)), glen)
        pos = torch.arange(int(glen.sum())) - torch.repeat_interleave(
            torch.cumsum(glen, 0) - glen, glen)
        token = (starts[group][member] + pos).to(q.device)
        member, pos = member.to(q.device), pos.to(q.device)

        def pad(x: torch.Tensor, member=member, pos=pos, token=token, n=len(group),
                longest=longest) -> torch.Tensor:
            return x.new_zeros(n, longest, *x.shape[1:]).index_put((member, pos), x[token])

        o = _padded_group(pad(qf), pad(kf), pad(vf), glen.to(q.device), scale, causal, window)
        # under autocast the group's matmuls come back in the autocast dtype
        out = out.index_put((token,), o[member, pos].to(acc))
    return out.to(q.dtype)
