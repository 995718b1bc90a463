"""FP8 GEMM on 32x32 block-scaled operands (Triton), C = A @ B in bf16.

Scheme: Hopper has no block-scaled MMA, so the K loop runs in steps of 32 (one scale block):
each step is an fp8 x fp8 tensor-core dot of a (BM x 32) by (32 x BN) tile into a fresh fp32
partial product, which is multiplied by the outer product of the A-scales of its rows' blocks
and the B-scales of its columns' blocks, then added to the fp32 accumulator. This is exactly
sum_k deq(A)[m, k] deq(B)[k, n] with fp32 accumulation, i.e. what the format means. The price
is one scale-multiply-add per accumulator element per 32 of K on the CUDA cores, which is why
the 128-block route (cuBLAS, promotion every 128 of K) can be faster.

``PIPE`` (autotuned) issues the next K-block's MMA before scaling the previous partial product,
a software pipeline that lets the scale FMAs overlap the tensor cores where the compiler keeps
the MMA in flight.

Operands are read through strides, so a transposed operand (``BlockFp8.t()``) needs no copy.
For Hopper's fp8 MMA both tiles should be K-contiguous in memory (A row-major, B column-major);
callers give the backward a K-contiguous copy of the weight bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.dispatch import Kernel, resolve_kernel
from gem_kernels.fp8.reference import BlockFp8, gemm_reference

_CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "GROUP_M": 8, "PIPE": pipe}, num_warps=w, num_stages=st)
    for bm, bn, w, st, pipe in (
        (128, 128, 8, 4, 0), (128, 128, 8, 4, 1), (128, 256, 8, 3, 0), (256, 128, 8, 3, 0),
        (128, 128, 4, 5, 0), (128, 128, 4, 5, 1), (128, 64, 4, 6, 0))
]


@triton.jit(do_not_specialize=["M"])
def _gemm_body(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, bias_ptr, M, N, K,
               stride_am, stride_ak, stride_bk, stride_bn,
               stride_sam, stride_sak, stride_sbk, stride_sbn, stride_cm, stride_cn,
               M_BUCKET, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
               PIPE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """M_BUCKET (M rounded up to a power of two) is only the autotuning key. HAS_BIAS adds
    bias[n] to the fp32 accumulator before the one rounding to C's dtype."""
    BK: tl.constexpr = 32
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    sa_ptrs = sa_ptr + (offs_m // 32) * stride_sam
    sb_ptrs = sb_ptr + (offs_n // 32) * stride_sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    n_k = tl.cdiv(K, BK)
    if PIPE:
        # Software pipeline: issue the next K-block's MMA before scaling the previous partial
        # product, so the tensor cores and the scale FMAs overlap.
        k_ok = offs_k < K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
        sa = tl.load(sa_ptrs, mask=mask_m, other=0.0)
        sb = tl.load(sb_ptrs, mask=mask_n, other=0.0)
        part = tl.dot(a, b)
        for kb in range(1, n_k):
            a_ptrs += BK * stride_ak
            b_ptrs += BK * stride_bk
            k_ok = offs_k < K - kb * BK
            a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
            nxt = tl.dot(a, b)
            acc += part * (sa[:, None] * sb[None, :])
            sa = tl.load(sa_ptrs + kb * stride_sak, mask=mask_m, other=0.0)
            sb = tl.load(sb_ptrs + kb * stride_sbk, mask=mask_n, other=0.0)
            part = nxt
        acc += part * (sa[:, None] * sb[None, :])
    else:
        for kb in range(0, n_k):
            k_ok = offs_k < K - kb * BK
            a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
            sa = tl.load(sa_ptrs + kb * stride_sak, mask=mask_m, other=0.0)
            sb = tl.load(sb_ptrs + kb * stride_sbk, mask=mask_n, other=0.0)
            part = tl.dot(a, b)
            acc += part * (sa[:, None] * sb[None, :])
            a_ptrs += BK * stride_ak
            b_ptrs += BK * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Keyed on M's power-of-two bucket, not M: token counts change every jagged batch, and an exact
# key would re-time all configs for each new one.
_gemm_autotuned = triton.autotune(configs=_CONFIGS,
                                  key=["M_BUCKET", "N", "K", "HAS_BIAS"])(_gemm_body)
# Below this many multiply-adds a fixed tile is used: timing 7 configs (and compiling them for a
# new shape) costs far more than any of them can save on a small product.
_AUTOTUNE_MIN_MACS = 2**33
_SMALL = {"BM": 128, "BN": 128, "GROUP_M": 8, "PIPE": 0, "num_warps": 8, "num_stages": 4}


def _check(a: BlockFp8, b: BlockFp8) -> None:
    if a.block != (32, 32) or b.block != (32, 32):
        raise ValueError("the Triton FP8 GEMM takes 32x32 block-scaled operands")
    if a.data.shape[1] != b.data.shape[0]:
        raise ValueError(f"inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)}")


def gemm_triton(a: BlockFp8, b: BlockFp8, out_dtype: torch.dtype = torch.bfloat16,
                autotune: bool = True, pipe: bool = True, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    _check(a, b)
    m, k = a.data.shape
    n = b.data.shape[1]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; the product has {n} columns")
    c = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    args = (a.data, b.data, a.scale, b.scale, c, c if bias is None else bias, m, n, k,
            a.data.stride(0), a.data.stride(1), b.data.stride(0), b.data.stride(1),
            a.scale.stride(0), a.scale.stride(1), b.scale.stride(0), b.scale.stride(1),
            c.stride(0), c.stride(1), triton.next_power_of_2(m))
    if autotune and m * n * k >= _AUTOTUNE_MIN_MACS:
        grid = lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)
        _gemm_autotuned[grid](*args, HAS_BIAS=bias is not None)
    elif autotune:  # small product on the GPU: one fixed tile
        grid = (triton.cdiv(m, _SMALL["BM"]) * triton.cdiv(n, _SMALL["BN"]),)
        _gemm_body[grid](*args, **_SMALL, HAS_BIAS=bias is not None)
    else:  # small fixed tiles: the interpreter and tiny shapes
        bm, bn = 32, 32
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _gemm_body[grid](*args, BM=bm, BN=bn, GROUP_M=4, PIPE=pipe, HAS_BIAS=bias is not None)
    return c


def gemm(a: BlockFp8, b: BlockFp8, out_dtype: torch.dtype = torch.bfloat16, *,
         kernel: Kernel | str | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A (M x K) @ B (K x N) (+ bias (N), added in fp32) for 32x32 block-scaled FP8 operands;
    fp32 accumulation."""
    which = resolve_kernel(kernel, a.data, b.data)
    if which is Kernel.PYTORCH:
        _check(a, b)
        return gemm_reference(a, b, out_dtype, bias=bias)
    return gemm_triton(a, b, out_dtype, autotune=a.data.device.type == "cuda", bias=bias)
