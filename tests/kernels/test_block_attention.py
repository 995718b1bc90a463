"""Block attention: reference semantics, RoPE, and the Triton kernels against the reference.

Without CUDA the Triton kernels run under the interpreter (fp16/fp32 only: its bf16 dot is
wrong); GPU tests (bf16 and fp16, head_dim 64/128) carry the gpu marker.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from gem_kernels.block_attention import (  # noqa: E402
    RopeConfig,
    RopeTables,
    apply_rope_reference,
    block_attention,
    block_attention_reference,
    build_rope_tables,
    sequence_positions,
)
from gem_kernels.dispatch import interpreting  # noqa: E402
from gem_kernels.testing import lognormal_lengths, offsets_from_lengths  # noqa: E402

interpreter = pytest.mark.skipif(not interpreting(),
                                 reason="CPU Triton interpreter tests (CUDA present)")
gpu = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Partial last blocks, sequences shorter than one block, exactly one block, an empty sequence.
LENGTHS = [70, 5, 64, 0, 130, 1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _naive(q, k, v, lengths, block, rope, causal, scale):  # noqa: ANN001
    """Loop over sequences and blocks; RoPE through complex multiplication (float64)."""
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].double() for x in (q, k, v))
        if rope is not None:
            d = q.shape[-1]
            inv = rope.base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
            rot = torch.polar(torch.ones(n, d // 2, dtype=torch.float64),
                              torch.arange(n, dtype=torch.float64)[:, None] * inv)[:, None]

            def apply(x, rot=rot, d=d):  # noqa: ANN001, ANN202
                z = torch.complex(x[..., :d // 2], x[..., d // 2:]) * rot
                return torch.cat([z.real, z.imag], -1)

            qs, ks = apply(qs), apply(ks)
        for b0 in range(0, n, block):
            b1 = min(b0 + block, n)
            s = torch.einsum("ihd,jhd->hij", qs[b0:b1], ks[b0:b1]) * scale
            if causal:
                m = torch.ones(b1 - b0, b1 - b0, dtype=torch.bool).tril()
                s = s.masked_fill(~m, float("-inf"))
            outs.append(torch.einsum("hij,jhd->ihd", s.softmax(-1), vs[b0:b1]))
        start += n
    return torch.cat(outs) if outs else q.new_zeros(0, *q.shape[1:]).double()


def _inputs(lengths, heads, dim, dtype, device="cpu", seed=0):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, generator=g).to(device=device, dtype=dtype)
               for _ in range(3))
    return q, k, v, offsets_from_lengths(lengths, device)


@pytest.mark.parametrize("rope", [None, RopeConfig(10000.0), RopeConfig(500.0)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [64, 16])
def test_reference_matches_per_block_loop(rope, causal, block) -> None:
    q, k, v, off = _inputs(LENGTHS, 2, 16, torch.float64)
    out = block_attention_reference(q, k, v, off, block=block, rope=rope, causal=causal)
    want = _naive(q, k, v, LENGTHS, block, rope, causal, 1 / math.sqrt(16))
    assert out.shape == q.shape
    # fp64 throughout; only the fp32 RoPE tables round (~1e-7)
    assert _rel(out, want) < (1e-12 if rope is None else 1e-6)


def test_rope_tables_and_positions() -> None:
    off = offsets_from_lengths([3, 0, 2])
    assert sequence_positions(off, 5).tolist() == [0, 1, 2, 0, 1]
    t = build_rope_tables(8, 4, base=100.0)
    assert torch.allclose(t.cos[0], torch.ones(2)) and torch.allclose(t.sin[0], torch.zeros(2))
    assert torch.allclose(t.sin[3, 1], torch.tensor(math.sin(3 / 10.0)))
    x = torch.randn(5, 2, 4)
    y = apply_rope_reference(x, sequence_positions(off, 5), t)
    # A rotation keeps each pair's norm and is the identity at position 0.
    pairs = lambda z: z[..., :2] ** 2 + z[..., 2:] ** 2  # noqa: E731
    assert torch.allclose(pairs(y), pairs(x), atol=1e-5)
    assert torch.equal(y[0], x[0]) and torch.equal(y[3], x[3])


def test_rope_relative_position_and_placement() -> None:
    """RoPE scores depend on relative position only, so a sequence's output does not depend on
    where it sits in the batch, and precomputed tables equal the config."""
    q, k, v, _ = _inputs([64], 2, 16, torch.float64, seed=1)
    alone = block_attention_reference(q, k, v, offsets_from_lengths([64]), rope=RopeConfig())
    pad = torch.randn(10, 2, 16, dtype=torch.float64)
    q2, k2, v2 = (torch.cat([pad, x]) for x in (q, k, v))
    tables = build_rope_tables(128, 16)
    after = block_attention_reference(q2, k2, v2, offsets_from_lengths([10, 64]),
                                      rope=RopeTables(tables.cos, tables.sin))
    assert torch.allclose(after[10:], alone, atol=1e-12)
    no_rope = block_attention_reference(q, k, v, offsets_from_lengths([64]))
    assert _rel(alone, no_rope) > 1e-3  # the rotation really changes the result


def test_blocks_are_independent() -> None:
    q, k, v, off = _inputs([130], 1, 16, torch.float64)
    out = block_attention_reference(q, k, v, off)
    k2 = k.clone()
    k2[64:128] = torch.randn(64, 1, 16, dtype=torch.float64)  # the second block only
    out2 = block_attention_reference(q, k2, v, off)
    assert torch.equal(out[:64], out2[:64]) and torch.equal(out[128:], out2[128:])
    assert not torch.allclose(out[64:128], out2[64:128])


def test_auto_dispatch_off_cuda_is_the_reference() -> None:
    q, k, v, off = _inputs(LENGTHS, 2, 64, torch.float32)
    assert torch.equal(block_attention(q, k, v, off, rope=RopeConfig()),
                       block_attention_reference(q, k, v, off, rope=RopeConfig()))


def _check_triton(lengths, heads, dim, dtype, device, rope, causal, tol, seed=0,  # noqa: ANN001
                  strided=False) -> None:
    q, k, v, off = _inputs(lengths, heads, dim, dtype, device, seed)
    if strided:  # q, k, v as views of one packed projection output
        packed = torch.stack([q, k, v], 1).contiguous()
        q, k, v = packed.unbind(1)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = block_attention(q, k, v, off, rope=rope, causal=causal, kernel="triton")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = block_attention_reference(qr, kr, vr, off, rope=rope, causal=causal)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout.double())
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < tol
    for g, rg in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(g).all()
        assert _rel(g, rg) < tol


@interpreter
@pytest.mark.parametrize("rope", [None, RopeConfig()])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_interpreter_fwd_bwd(rope, causal) -> None:
    _check_triton(LENGTHS, 2, 64, torch.float16, "cpu", rope, causal, tol=3e-3)


@interpreter
def test_triton_interpreter_absolute_rope_tables() -> None:
    """RopeTables take the absolute-position path (a table row per position in the sequence);
    RopeConfig the block-relative one. Both match the reference, and each other."""
    tables = build_rope_tables(256, 64, base=777.0)
    rope = RopeTables(tables.cos, tables.sin)
    _check_triton(LENGTHS, 2, 64, torch.float16, "cpu", rope, False, tol=3e-3, seed=2)
    q, k, v, off = _inputs(LENGTHS, 2, 64, torch.float16, seed=3)
    absolute = block_attention(q, k, v, off, rope=rope, kernel="triton")
    relative = block_attention(q, k, v, off, rope=RopeConfig(777.0), kernel="triton")
    assert _rel(relative, absolute) < 3e-3


@interpreter
def test_triton_interpreter_head_dim_128_strided_views() -> None:
    _check_triton([3, 66], 1, 128, torch.float16, "cpu", RopeConfig(), False, tol=3e-3,
                  strided=True)


@interpreter
def test_triton_rejects_unsupported_dtype() -> None:
    q, k, v, off = _inputs([5], 1, 64, torch.float32)
    with pytest.raises(RuntimeError):
        block_attention(q, k, v, off, kernel="triton")
    # auto falls back to the reference for shapes the kernel does not cover
    q, k, v, off = _inputs([5], 1, 32, torch.float16)
    assert block_attention(q, k, v, off).shape == q.shape


@pytest.mark.parametrize(("dtype", "dim", "rope", "causal"), [
    (torch.bfloat16, 128, RopeConfig(), False),
    (torch.bfloat16, 128, None, True),
    (torch.bfloat16, 64, RopeConfig(), True),
    (torch.float16, 64, None, False),
    (torch.float16, 128, RopeConfig(), False),
    (torch.float16, 64, RopeConfig(500.0), False),
])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_gpu_fwd_bwd(dtype, dim, rope, causal) -> None:
    lengths = LENGTHS + lognormal_lengths(24, mean=300, max_len=4096, seed=3)
    _check_triton(lengths, 4, dim, dtype, "cuda", rope, causal,
                  tol=2e-2 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hoist", [False, True])
def test_triton_gpu_rope_paths(hoist) -> None:
    """Block-relative RoPE (table hoisted into registers or read per tile; P V split or not)
    and absolute RopeTables, bf16, long sequences (positions far past one block)."""
    from gem_kernels.block_attention import autograd as ba

    saved = ba.DEFAULT_META[128]
    ba.DEFAULT_META[128] = ({**saved[0], "HOIST": hoist, "SPLIT_PV": hoist}, saved[1])
    try:
        lengths = [4096, 1000, 63, 65]
        _check_triton(lengths, 4, 128, torch.bfloat16, "cuda", RopeConfig(), True, tol=2e-2)
        t = build_rope_tables(4096, 128)
        _check_triton(lengths, 4, 128, torch.bfloat16, "cuda", RopeTables(t.cos, t.sin), False,
                      tol=2e-2)
    finally:
        ba.DEFAULT_META[128] = saved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_gpu_strided_views_and_every_row_written() -> None:
    _check_triton([1, 63, 64, 65, 4096], 8, 128, torch.bfloat16, "cuda", RopeConfig(), False,
                  tol=2e-2, strided=True)
    q, k, v, off = _inputs([1, 200, 3000], 4, 128, torch.bfloat16, "cuda", seed=5)
    a = block_attention(q, k, v, off, rope=RopeConfig())
    b = block_attention(q, k, v, off, rope=RopeConfig())
    assert torch.equal(a, b)  # deterministic, and no stale memory leaks in


def _with_meta(dim: int, fwd: dict, bwd: dict, fn):  # noqa: ANN001, ANN202
    """Run fn with the default launch settings of head_dim dim replaced (restored after)."""
    from gem_kernels.block_attention import autograd as ba

    saved = ba.DEFAULT_META[dim]
    ba.DEFAULT_META[dim] = ({**saved[0], **fwd}, {**saved[1], **bwd})
    try:
        return fn()
    finally:
        ba.DEFAULT_META[dim] = saved


def _out_and_grads(lengths, heads, dim, dtype, device, seed=4):  # noqa: ANN001, ANN202
    q, k, v, off = _inputs(lengths, heads, dim, dtype, device, seed)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = block_attention(q, k, v, off, rope=RopeConfig(), kernel="triton")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@interpreter
def test_triton_interpreter_item_order_does_not_change_results() -> None:
    """Strided and chunked item orders, plan rows read as a vector or as scalars: every
    (block, head) item is computed the same way, so the outputs and gradients are identical,
    bit for bit (7 blocks x 3 heads over 4 programs)."""
    lengths = [70, 5, 64, 130, 1]
    runs = [_with_meta(64, {"STRIDE": s, "VEC_PLAN": v}, {"STRIDE": s, "VEC_PLAN": v},
                       lambda: _out_and_grads(lengths, 3, 64, torch.float16, "cpu"))
            for s, v in ((True, True), (False, False), (True, False))]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dim", [64, 128])
def test_triton_gpu_launch_settings_do_not_change_results(dim) -> None:
    """Item order, programs per SM (above what fits too) and pipelining depth change the
    schedule only: outputs and gradients are identical, bit for bit. Eight warps lay the tiles
    out differently (other reduction order), so they agree to rounding."""
    lengths = [4096, 1000, 63, 65, 1] + lognormal_lengths(40, mean=300, max_len=4096, seed=7)
    settings = [({"STRIDE": True, "VEC_PLAN": True, "CTAS": 1, "num_stages": 3,
                  "num_warps": 4}, {"STRIDE": True, "VEC_PLAN": True, "num_warps": 4}),
                ({"STRIDE": False, "VEC_PLAN": False, "CTAS": 8, "num_stages": 2,
                  "num_warps": 4}, {"STRIDE": False, "CTAS": 8, "num_warps": 4}),
                ({"STRIDE": True, "VEC_PLAN": False, "CTAS": 2, "num_stages": 3,
                  "num_warps": 4}, {"STRIDE": True, "VEC_PLAN": False, "CTAS": 1,
                                    "num_stages": 2, "num_warps": 4}),
                ({"STRIDE": True, "CTAS": 1, "num_stages": 3, "num_warps": 8},
                 {"STRIDE": True, "CTAS": 1, "num_stages": 2, "num_warps": 8})]
    runs = [_with_meta(dim, f, b, lambda: _out_and_grads(lengths, 4, dim, torch.bfloat16,
                                                          "cuda"))
            for f, b in settings]
    for other in runs[1:-1]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(runs[0], runs[-1], strict=True):
        assert _rel(b, a) < 1e-2
