"""Pure PyTorch reference for 64-token block attention: exact, differentiable by autograd.

Semantics (shared with the Triton kernels):
- q, k, v: (total_tokens, heads, head_dim); offsets: int64 (B+1,), sequence b owns rows
  offsets[b]:offsets[b+1]. Each sequence is cut into consecutive blocks of ``block`` tokens
  starting at its first token; the last block may be partial (a sequence shorter than one
  block is one partial block).
- Each query attends only to the keys of its own block: softmax attention within the block,
  non-causal by default (every query sees every key of its block); ``causal=True`` keeps keys
  at or before the query's position.
- rope (RopeConfig or RopeTables) rotates q and k by position within the sequence before the
  scores; v is not rotated.
- scale defaults to 1/sqrt(head_dim).
Scores, softmax and the PV product are computed in fp32 (fp64 for fp64 inputs); the output
has q's dtype. RoPE tables are fp32.
"""

from __future__ import annotations

import math

import torch

from gem_kernels.block_attention.rope import (
    Rope,
    apply_rope_reference,
    rope_tables_for,
    sequence_positions,
)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                 block: int) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one (total_tokens, heads, head_dim) shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError("offsets must be a 1-D (B+1,) tensor")
    if block < 1:
        raise ValueError(f"block must be >= 1; got {block}")


def block_layout(offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-token (global block index, slot within the block) and the number of blocks.

    Reads offsets on the host (the reference is allowed to synchronise).
    """
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
    nblocks = (lengths + block - 1) // block
    first_block = torch.cumsum(nblocks, 0) - nblocks
    total = int(offsets[-1].item()) if offsets.numel() > 1 else 0
    t = torch.arange(total, device=offsets.device, dtype=torch.int64)
    seq = torch.searchsorted(offsets[1:].contiguous(), t, right=True)
    pos = t - offsets[seq]
    return first_block[seq] + pos // block, pos % block, int(nblocks.sum().item())


def block_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              offsets: torch.Tensor, *, block: int = 64, rope: Rope | None = None,
                              scale: float | None = None, causal: bool = False,
                              kernel: object = None) -> torch.Tensor:
    """Block attention by scattering tokens into (blocks, block, H, d) and masking padded keys.

    Same signature as ``block_attention`` (``kernel`` is accepted and ignored).
    """
    del kernel
    check_inputs(q, k, v, offsets, block)
    total, heads, dim = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    offsets = offsets.to(q.device)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(compute), k.to(compute), v.to(compute)
    if rope is not None:
        positions = sequence_positions(offsets, total)
        tables = rope_tables_for(rope, max(int(positions.max().item()) + 1, 1) if total else 1,
                                 dim, q.device)
        qf = apply_rope_reference(qf, positions, tables)
        kf = apply_rope_reference(kf, positions, tables)
    blk, slot, nb = block_layout(offsets, block)
    flat = blk * block + slot

    def to_blocks(x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros(nb * block, heads, dim).index_put((flat,), x)
        return padded.view(nb, block, heads, dim).transpose(1, 2)  # (nb, H, block, d)

    qb, kb, vb = to_blocks(qf), to_blocks(kf), to_blocks(vf)
    valid = torch.zeros(nb * block, dtype=torch.bool, device=q.device)
    valid[flat] = True
    allowed = valid.view(nb, 1, 1, block).expand(nb, 1, block, block)
    if causal:
        i = torch.arange(block, device=q.device)
        allowed = allowed & (i[None, :] <= i[:, None]).view(1, 1, block, block)
    s = torch.einsum("nhid,nhjd->nhij", qb, kb) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)  # every block has >= 1 valid key, so no all -inf row
    ob = torch.einsum("nhij,nhjd->nhid", p, vb)
    out = ob.transpose(1, 2).reshape(nb * block, heads, dim)[flat]
    return out.to(q.dtype)
