"""Jagged flash attention: the reference's semantics, and the Triton kernels (forward and all
gradients) against the reference.

Without CUDA the Triton kernels run under the CPU interpreter on small shapes (fp16: the
interpreter's bf16 dot is not trustworthy); GPU tests (bf16 and fp16, head_dim 64 and 128,
lengths 0, 1, 63, 64, 65 and 4096 in one batch) carry the gpu marker.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch.nn.functional as F  # noqa: E402

from gem_kernels.dispatch import Kernel, interpreting, resolve_kernel  # noqa: E402
from gem_kernels.jagged_attention import (  # noqa: E402
    jagged_attention,
    jagged_attention_reference,
)
from gem_kernels.jagged_attention.op import jagged_attention_triton  # noqa: E402
from gem_kernels.jagged_attention.reference import attention_mask  # noqa: E402
from gem_kernels.jagged_attention.schedule import (  # noqa: E402
    build_schedule,
    build_schedule_torch,
)
from gem_kernels.testing import offsets_from_lengths  # noqa: E402

interpreter = pytest.mark.skipif(not interpreting(),
                                 reason="CPU Triton interpreter tests (CUDA present)")
gpu = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MASKS = [(False, None), (True, None), (False, (7, 3)), (True, (20, 0)), (False, (0, 40))]


def _rand(lengths, heads, dim, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return [torch.randn(total, heads, dim, generator=g).to(device=device, dtype=dtype)
            for _ in range(4)]


def _naive(q, k, v, lengths, causal, window, scale=None):
    """Per-sequence SDPA with an explicit boolean mask, float64."""
    outs, start = [], 0
    for n in lengths:
        if n == 0:
            continue
        qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))
        mask = attention_mask(n, causal, window)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
                    .transpose(0, 1))
        start += n
    return torch.cat(outs) if outs else torch.zeros(0, *q.shape[1:], dtype=torch.float64)


def _grads_ref(q, k, v, do, offsets, max_len, causal, window):
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    o = jagged_attention_reference(qr, kr, vr, offsets, max_len, causal=causal, window=window)
    return (o, *torch.autograd.grad(o, (qr, kr, vr), do.float()))


def _grads(q, k, v, do, offsets, max_len, causal, window, options=None, **kw):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    if options is not None:  # kernel options (load path, boundary mode) go to the Triton op
        kw.pop("kernel", None)
        o = jagged_attention_triton(q, k, v, offsets, max_len, causal=causal, window=window,
                                    options=options, **kw)
    else:
        o = jagged_attention(q, k, v, offsets, max_len, causal=causal, window=window, **kw)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- reference

@pytest.mark.parametrize("causal,window", MASKS)
def test_reference_matches_naive(causal, window):
    lengths = [7, 0, 12, 1, 45]
    q, k, v, _ = _rand(lengths, 3, 16, torch.float64)
    out = jagged_attention_reference(q, k, v, offsets_from_lengths(lengths), 45, causal=causal,
                                     window=window)
    torch.testing.assert_close(out, _naive(q, k, v, lengths, causal, window))


def test_reference_scale_and_dtype():
    lengths = [9, 4]
    q, k, v, _ = _rand(lengths, 2, 8, torch.float64)
    out = jagged_attention_reference(q.half(), k.half(), v.half(), offsets_from_lengths(lengths),
                                     9, scale=0.3)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), _naive(q, k, v, lengths, False, None, scale=0.3),
                               atol=3e-3, rtol=3e-3)


def test_reference_empty_sequences_and_grads():
    lengths = [0, 3, 0, 0, 2, 0]
    q, k, v, do = _rand(lengths, 2, 8, torch.float64)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = jagged_attention_reference(q, k, v, offsets_from_lengths(lengths), 3, causal=True)
    assert out.shape == q.shape
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), do)
    assert all(torch.isfinite(g).all() for g in (gq, gk, gv))
    # one token attends only to itself
    torch.testing.assert_close(out[3], v[3])


def test_reference_all_empty():
    q, k, v, _ = _rand([0, 0], 2, 8, torch.float32)
    out = jagged_attention_reference(q, k, v, offsets_from_lengths([0, 0]), 0)
    assert out.shape == (0, 2, 8)


def test_reference_gradcheck():
    lengths = [3, 0, 4]
    q, k, v, _ = _rand(lengths, 1, 4, torch.float64)
    offs = offsets_from_lengths(lengths)
    for causal, window in [(False, None), (True, (1, 0)), (False, (1, 2))]:
        args = tuple(x.clone().requires_grad_() for x in (q, k, v))
        assert torch.autograd.gradcheck(
            lambda a, b, c, cz=causal, w=window: jagged_attention_reference(
                a, b, c, offs, 4, causal=cz, window=w), args)


def test_dispatch_off_cuda_is_reference():
    q, k, v, _ = _rand([5, 3], 2, 16, torch.float32)
    assert resolve_kernel(None, q) is Kernel.PYTORCH
    out = jagged_attention(q, k, v, offsets_from_lengths([5, 3]), 5)
    torch.testing.assert_close(out, jagged_attention_reference(q, k, v,
                                                               offsets_from_lengths([5, 3]), 5))


def test_schedule_covers_every_block_once_longest_first():
    lengths = [5, 0, 130, 64, 1, 65]
    offs = offsets_from_lengths(lengths)
    s = build_schedule(offs, sum(lengths), 64)
    seq, blk = s[0].tolist(), s[1].tolist()
    pairs = [(a, b) for a, b in zip(seq, blk, strict=True) if a >= 0]
    expect = {(b, i) for b, n in enumerate(lengths) for i in range((n + 63) // 64)}
    assert sorted(pairs) == sorted(expect) and len(pairs) == len(expect)
    firsts = []
    for a, _ in pairs:
        if a not in firsts:
            firsts.append(a)
    assert [lengths[a] for a in firsts] == sorted((n for n in lengths if n), reverse=True)
    assert all(a == -1 for a in seq[len(pairs):])
    # the one-program Triton builder (interpreter here, CUDA on the GPU) and the torch ops agree
    torch.testing.assert_close(s, build_schedule_torch(offs, sum(lengths), 64), rtol=0, atol=0)


# ----------------------------------------------------------------------------- interpreter

INTERP_LENGTHS = [0, 1, 31, 32, 33, 70, 0, 5]


@interpreter
@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("use_tma", ["ptr", "tma_ragged", "tma_device"])
def test_triton_interpreter_matches_reference(causal, window, use_tma):
    lengths = INTERP_LENGTHS
    offs = offsets_from_lengths(lengths)
    q, k, v, do = _rand(lengths, 2, 16, torch.float16, seed=1)
    opts = {"fwd": {"use_tma": use_tma}, "bwd": {"use_tma": use_tma}}
    got = _grads(q, k, v, do, offs, max(lengths), causal, window, kernel="triton",
                 options=opts)
    ref = _grads_ref(q, k, v, do, offs, max(lengths), causal, window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert a.dtype == torch.float16
        assert _rel(a, b) < 2e-3, name


@interpreter
@pytest.mark.parametrize("boundary", ["trick", "trick_fused", "where", "mask_all"])
def test_triton_interpreter_boundary_modes(boundary):
    lengths = [33, 5, 16, 47]
    offs = offsets_from_lengths(lengths)
    q, k, v, do = _rand(lengths, 1, 16, torch.float16, seed=2)
    got = _grads(q, k, v, do, offs, 47, False, None, kernel="triton",
                 options={"fwd": {"boundary": boundary}})
    ref = _grads_ref(q, k, v, do, offs, 47, False, None)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert _rel(a, b) < 2e-3, name


@interpreter
@pytest.mark.parametrize("boundary", ["trick", "trick_fused"])
def test_triton_interpreter_boundary_trick_exact_for_very_negative_scores(boundary):
    """Every real score far below zero: the zero-filled keys (score 0) dominate the raw row sum
    and the subtraction alone would cancel catastrophically; the guard must keep it exact."""
    lengths = [5, 20, 3]
    offs = offsets_from_lengths(lengths)
    q, k, v, do = _rand(lengths, 1, 16, torch.float16, seed=3)
    q = (q.abs() + 1.0).to(torch.float16)
    k = (-(k.abs() + 1.0) * 4).to(torch.float16)  # q.k <= -64, scaled <= -16 per pair
    got = _grads(q, k, v, do, offs, 20, False, None, kernel="triton",
                 options={"fwd": {"boundary": boundary}})
    ref = _grads_ref(q, k, v, do, offs, 20, False, None)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) < 5e-3, name


@interpreter
def test_triton_interpreter_strided_inputs_and_scale():
    """q, k, v as slices of one fused (T, 3, H, D) projection; explicit scale."""
    lengths = [17, 0, 40]
    offs = offsets_from_lengths(lengths)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(sum(lengths), 3, 2, 32, generator=g).half()
    q, k, v = qkv.unbind(1)
    do = torch.randn(sum(lengths), 2, 32, generator=g).half()
    got = _grads(q, k, v, do, offs, 40, True, None, kernel="triton", scale=0.2)
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    o = jagged_attention_reference(qr, kr, vr, offs, 40, causal=True, scale=0.2)
    ref = (o, *torch.autograd.grad(o, (qr, kr, vr), do.float()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert _rel(a, b) < 2e-3, name


# ----------------------------------------------------------------------------- GPU

GPU_LENGTHS = [0, 1, 63, 64, 65, 4096]
GPU_MASKS = [(False, None), (True, None), (False, (63, 0)), (True, (255, 0)), (False, (100, 37))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal,window", GPU_MASKS)
def test_triton_gpu_matches_reference(causal, window, head_dim, dtype):
    lengths = GPU_LENGTHS
    offs = offsets_from_lengths(lengths, "cuda")
    q, k, v, do = _rand(lengths, 4, head_dim, dtype, "cuda", seed=5)
    got = _grads(q, k, v, do, offs, max(lengths), causal, window)
    ref = _grads_ref(q, k, v, do, offs, max(lengths), causal, window)
    tol = 1.5e-2 if dtype == torch.bfloat16 else 4e-3
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert a.dtype == dtype
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) < tol, (name, _rel(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("boundary", ["trick", "trick_fused", "where", "mask_all"])
@pytest.mark.parametrize("use_tma", ["ptr", "tma_ragged", "tma_device"])
def test_triton_gpu_boundary_and_load_paths(boundary, use_tma):
    lengths = [5, 127, 128, 129, 700, 0, 2000]
    offs = offsets_from_lengths(lengths, "cuda")
    q, k, v, do = _rand(lengths, 4, 128, torch.bfloat16, "cuda", seed=6)
    opts = {"fwd": {"boundary": boundary, "use_tma": use_tma}, "bwd": {"use_tma": use_tma}}
    got = _grads(q, k, v, do, offs, 2000, False, None, options=opts)
    ref = _grads_ref(q, k, v, do, offs, 2000, False, None)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert _rel(a, b) < 1.5e-2, (name, _rel(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_schedule_kernel_matches_torch():
    from gem_kernels.testing import lognormal_lengths

    for lengths in ([5, 0, 130, 64, 1, 65], lognormal_lengths(3000, 300, 4096, seed=2), [0]):
        offs = offsets_from_lengths(lengths, "cuda")
        for block in (64, 128):
            a = build_schedule(offs, sum(lengths), block)
            b = build_schedule_torch(offs, sum(lengths), block)
            assert torch.equal(a, b)
    from gem_kernels.jagged_attention import schedule

    assert not schedule._KERNEL_FAILED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_gpu_backward_deterministic():
    lengths = [300, 17, 1000, 64]
    offs = offsets_from_lengths(lengths, "cuda")
    q, k, v, do = _rand(lengths, 4, 128, torch.bfloat16, "cuda", seed=7)
    a = _grads(q, k, v, do, offs, 1000, True, None, deterministic=True)
    b = _grads(q, k, v, do, offs, 1000, True, None, deterministic=True)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_default_boundary_one_loop_without_masks_band_masks_otherwise():
    from gem_kernels.jagged_attention.op import default_boundary

    assert default_boundary(128, False, None) == "mask_all"
    assert default_boundary(64, False, None) == "trick_fused"
    # with causal/window masks only band tiles are masked ('mask_all' would mask them all)
    assert default_boundary(128, True, None) == "trick"
    assert default_boundary(64, False, (63, 0)) == "trick"
