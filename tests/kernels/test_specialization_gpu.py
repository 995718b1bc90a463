"""A new batch never compiles a new Triton kernel: the per-batch scalars (token counts, schedule
lengths, batch sizes) are not specialized on (``do_not_specialize``), so batches whose totals
differ in divisibility by 16 or equal 1 run the kernels the first batch compiled."""

from __future__ import annotations

import pytest
import torch
import triton

from gem_kernels.block_attention import block_attention
from gem_kernels.gdpa import gdpa
from gem_kernels.jagged_attention import jagged_attention

pytestmark = pytest.mark.gpu
H, D = 2, 64


def _batch(lengths: list[int], seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = torch.cumsum(torch.tensor(lengths, device="cuda"), 0)
    q, k, v = (torch.randn(sum(lengths), H, D, device="cuda", dtype=torch.bfloat16,
                           generator=g).requires_grad_(True) for _ in range(3))
    return q, k, v, offsets


def _step(lengths: list[int], seed: int) -> None:
    q, k, v, off = _batch(lengths, seed)
    m = max(lengths)
    out = (jagged_attention(q, k, v, off, m, causal=True)
           + block_attention(q, k, v, off, causal=True)
           + gdpa(q, k, v, off, off, m, m))
    out.float().sum().backward()


@pytest.fixture
def compiles():
    seen: list[str] = []
    before = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"]) and None
    yield seen
    triton.knobs.runtime.jit_post_compile_hook = before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batches_of_other_totals_compile_nothing(compiles):
    _step([300, 17, 95, 200], seed=0)  # total 612: not a multiple of 16
    torch.cuda.synchronize()
    first = len(compiles)
    for seed, lengths in enumerate(([304, 16, 96, 200], [301, 18, 1, 200], [640, 16])):
        _step(lengths, seed + 1)  # totals 616, 520 (a multiple of 16 and 8), 656
    torch.cuda.synchronize()
    assert first > 0
    assert compiles[first:] == [], "a later batch compiled new kernels"
