"""Pure PyTorch reference for GDPA: exact, differentiable by autograd, any device.

Semantics (shared with the Triton kernels):
- q: (total_q, H, d) with int64 offsets q_offsets (B+1,); k, v: (total_kv, H, d) with
  kv_offsets (B+1,). Query row i of sample b sees exactly the KV rows of sample b.
- out_i = sum_j act(scale * q_i . k_j) * v_j, no softmax; scale defaults to 1/sqrt(d).
- norm="kv_len" divides sample b's rows by its KV length (a sample with no KV outputs 0),
  norm="max_len" divides by max_kv.
- max_q / max_kv must be >= every sample's Q / KV length (they size the padding here).
The reference pads to (B, max_q) x (B, max_kv), computes in fp32 and returns q's dtype.
"""

from __future__ import annotations

import math

import torch

from gem_kernels.gdpa.activations import ACTIVATIONS, apply_activation

NORMS = ("none", "kv_len", "max_len")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                 kv_offsets: torch.Tensor, activation: str, norm: str) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"need q (total_q, H, d) and k, v (total_kv, H, d); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q_offsets.dim() != 1 or kv_offsets.shape != q_offsets.shape or q_offsets.numel() < 1:
        raise ValueError("q_offsets and kv_offsets must both be 1-D (B+1,) tensors")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}; got {norm!r}")


def pad_jagged(x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> tuple[torch.Tensor,
                                                                                torch.Tensor]:
    """(total, H, d) jagged -> (B, max_len, H, d) zero-padded, and the (B, max_len) validity."""
    lengths = offsets[1:] - offsets[:-1]
    pos = torch.arange(max_len, device=x.device)
    valid = pos[None, :] < lengths[:, None]
    idx = (offsets[:-1, None] + pos[None, :]).clamp_max(max(x.shape[0] - 1, 0))
    if x.shape[0] == 0:
        padded = x.new_zeros(lengths.numel(), max_len, *x.shape[1:])
    else:
        padded = torch.where(valid[..., None, None], x[idx], x.new_zeros(()))
    return padded, valid


def unpad_jagged(x: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    """(B, max_len, H, d) padded -> (total, H, d) jagged rows."""
    lengths = offsets[1:] - offsets[:-1]
    batch = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths,
                                    output_size=total)
    pos = torch.arange(total, device=x.device) - offsets[:-1][batch]
    return x[batch, pos]


def gdpa_padded(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                kv_valid: torch.Tensor | None, *, activation: str = "silu",
                scale: float | None = None, norm: str = "none", max_kv: int | None = None,
                kv_len: torch.Tensor | None = None) -> torch.Tensor:
    """GDPA on zero-padded (B, Lq, H, d) / (B, Lkv, H, d) tensors in their own dtype.

    kv_valid: (B, Lkv) bool mask of real keys, or None to skip masking: every activation here
    has act(0) = 0, so zero-padded K and V rows contribute exactly 0 anyway. kv_len: (B,)
    lengths for norm="kv_len" (taken from kv_valid when None)."""
    if scale is None:
        scale = 1.0 / math.sqrt(qp.shape[-1])
    s = torch.einsum("bqhd,bkhd->bhqk", qp, kp) * scale
    p = apply_activation(s, activation)
    if kv_valid is not None:
        p = p * kv_valid[:, None, None, :].to(s.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vp)
    if norm == "kv_len":
        n = kv_len if kv_len is not None else kv_valid.sum(dim=1)
        out = out / n.clamp_min(1).to(out.dtype)[:, None, None, None]
    elif norm == "max_len":
        out = out / float(max_kv if max_kv is not None else kp.shape[1])
    return out


def gdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                   kv_offsets: torch.Tensor, max_q: int, max_kv: int, *,
                   activation: str = "silu", scale: float | None = None, norm: str = "none",
                   kernel: object = None) -> torch.Tensor:
    """GDPA on jagged tensors, exact in fp32. Same signature as ``gdpa`` (``kernel`` is
    accepted and ignored)."""
    del kernel
    check_inputs(q, k, v, q_offsets, kv_offsets, activation, norm)
    total_q = q.shape[0]
    if total_q == 0:
        return q.new_zeros(q.shape) + 0.0 * (k.sum() + v.sum())  # keeps the autograd graph
    max_q = max(int(max_q), 1)
    max_kv = max(int(max_kv), 1)
    q_offsets = q_offsets.to(q.device, torch.int64)
    kv_offsets = kv_offsets.to(q.device, torch.int64)
    qp, _ = pad_jagged(q.float(), q_offsets, max_q)
    kp, kv_valid = pad_jagged(k.float(), kv_offsets, max_kv)
    vp, _ = pad_jagged(v.float(), kv_offsets, max_kv)
    out = gdpa_padded(qp, kp, vp, kv_valid, activation=activation, scale=scale, norm=norm,
                      max_kv=max_kv)
    return unpad_jagged(out, q_offsets, total_q).to(q.dtype)
