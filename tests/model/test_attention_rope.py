"""RoPE in every kind of the model's self-attention: block attention rotates q and k in its
kernel, the others through the dispatch, with gem_kernels' one RoPE reference, so a token
sees the exact distance to every key it attends to."""

from __future__ import annotations

import pytest
import torch

from gem_platform.model.attention import SelfAttentionSpec, self_attention


def _jagged(lengths: list[int], heads: int = 2, dim: int = 16, seed: int = 0
            ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, generator=g, dtype=torch.float64)
               for _ in range(3))
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, offsets


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """x (n, H, d) rotated by position 0..n-1: rotate-half pairs, base 10000."""
    half = x.shape[-1] // 2
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = torch.arange(x.shape[0], dtype=torch.float64)[:, None, None] * inv
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
           causal: bool) -> torch.Tensor:
    """Per sequence: q and k rotated by position, then a masked softmax."""
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n] for x in (q, k, v))
        s = torch.einsum("ihd,jhd->hij", _rotate(qs), _rotate(ks)) / q.shape[-1] ** 0.5
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.einsum("hij,jhd->ihd", s.softmax(-1), vs))
        start += n
    return torch.cat(out)


LENGTHS = [1, 17, 40, 64, 63]


# block64 only unmasked: the model's block attention is bidirectional within a block
CASES = [(kind, causal) for kind in ("full", "sliding", "padded") for causal in (True, False)]


@pytest.mark.parametrize(("kind", "causal"), [*CASES, ("block64", False)])
def test_rope_in_every_kind_matches_rotated_attention(kind: str, causal: bool) -> None:
    """Histories of at most 64 events fit in one block and one window of 64: every kind
    computes RoPE attention there."""
    q, k, v, offsets = _jagged(LENGTHS)
    spec = SelfAttentionSpec(kind, window=64, causal=causal, rope_base=10000.0)
    got = self_attention(q, k, v, offsets, 64, spec)
    torch.testing.assert_close(got, _naive(q, k, v, LENGTHS, causal))
    plain = self_attention(q, k, v, offsets, 64, SelfAttentionSpec(kind, window=64,
                                                                   causal=causal))
    assert (plain - got).abs().amax() > 1e-2  # RoPE is applied, not ignored


def test_attention_with_rope_reads_relative_distance_only() -> None:
    """Scores under RoPE depend on distances, not places: the newest event of a history
    whose window holds exactly the same 150 events after a 30-event prefix gets the same
    output as in that history alone; without RoPE positions would not matter either, so the
    same check with the prefix's events in the window tells that they are not ignored."""
    q, k, v, offsets = _jagged([150])
    prefix = _jagged([30], seed=1)
    joined = [torch.cat([p, x]) for p, x in zip(prefix[:3], (q, k, v), strict=True)]
    spec = SelfAttentionSpec("full", causal=True, rope_base=10000.0)
    alone = self_attention(q, k, v, offsets, 150, spec)
    window = SelfAttentionSpec("sliding", window=149, causal=True, rope_base=10000.0)
    shifted = self_attention(*joined, torch.tensor([0, 180]), 180, window)
    torch.testing.assert_close(shifted[-1], alone[-1])
    wider = self_attention(*joined, torch.tensor([0, 180]), 180, spec)
    assert (wider[-1] - alone[-1]).abs().amax() > 1e-3
