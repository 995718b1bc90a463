"""PyTorch reference for block-scaled FP8: the format, quantize/dequantize and the GEMM.

Format. A 2-D tensor X (R x C) becomes ``data`` (float8_e4m3fn, R x C) and ``scale`` (fp32,
ceil(R/br) x ceil(C/bc)), one power-of-two scale per (br x bc) block, so that
X ~= data * scale blockwise. The scale is the smallest power of two with amax / scale <= 448
(e4m3's largest finite value), so nothing saturates and scaling is exact (no rounding from the
scale itself). Square blocks (32 x 32) survive transposition: the transposed operand is the same
bytes read with swapped strides, and its scales are ``scale.t()``.

Optional random Hadamard transform: before quantizing, the column dimension is multiplied by the
block-diagonal orthogonal matrix Q = diag(signs) H_n / sqrt(n) (n = hadamard block, 32..128,
random signs from a seed). Applying the same Q to the reduction dimension of both operands leaves
the product unchanged, (X Q)(W Q)^T = X W^T, while spreading outliers across a block.

Optional stochastic rounding: each value rounds to one of its two fp8 neighbours with probability
proportional to proximity, so the expected result equals the input (unbiased).

This module is the specification the Triton kernels are tested against, and the CPU path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# e4m3: 3 mantissa bits, smallest normal exponent -6 (subnormal spacing 2**-9).
_MANT_BITS = 3
_MIN_EXP = -6


@dataclass
class BlockFp8:
    """An fp8 tensor with one fp32 power-of-two scale per (block[0] x block[1]) block."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def t(self) -> BlockFp8:
        """The transposed operand: same bytes and scales, swapped strides (no requantization)."""
        return BlockFp8(self.data.t(), self.scale.t(), (self.block[1], self.block[0]))

    def k_major(self) -> BlockFp8:
        """The same values with the row (reduction) dimension contiguous, for a GEMM that
        reduces over rows: Hopper's fp8 MMA wants both operands K-major. Copies the bytes."""
        return BlockFp8(self.data.t().contiguous().t(), self.scale, self.block)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return (-(-rows // block[0]), -(-cols // block[1]))


def hadamard_matrix(n: int, seed: int = 0, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, normalized: bool = True) -> torch.Tensor:
    """diag(random signs) @ H_n (Sylvester), divided by sqrt(n) when ``normalized``.

    Unnormalized entries are exactly +-1 (exact in bf16), which the kernel multiplies by then
    scales; normalized, Q Q^T = I.
    """
    if n < 2 or n & (n - 1):
        raise ValueError(f"hadamard block must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) * 2 - 1
    q = signs.to(torch.float64)[:, None] * h
    if normalized:
        q = q / math.sqrt(n)
    return q.to(device=device, dtype=dtype)


def apply_hadamard(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x @ blockdiag(q, q, ...) along the last dimension (length divisible by q's size)."""
    n = q.shape[0]
    if x.shape[-1] % n:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of hadamard block {n}")
    shp = x.shape
    return (x.reshape(-1, shp[-1] // n, n) @ q.to(x.dtype)).reshape(shp)


def pow2_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """e = ceil(log2(amax / 448)) computed exactly from the fp32 bits (int32, clamped)."""
    bits = amax.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127
    mant = bits & 0x7FFFFF
    # amax = m * 2**E with m in [1, 2); 448 = 1.75 * 2**8; so e = E - 8 + (m > 1.75).
    e = exp - 8 + (mant > 0x600000).to(torch.int32)
    return e.clamp(-126, 127)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """2**e as an exact fp32 from the exponent bits (e in [-126, 127])."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def stochastic_round_e4m3(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Round fp32 |v| <= 448 to an e4m3 neighbour: up with probability = distance from below.

    u: uniform [0, 1) of v's shape. Exact result, representable in e4m3, so the final cast is
    lossless.
    """
    bits = v.abs().contiguous().view(torch.int32)
    e = (((bits >> 23) & 0xFF) - 127).clamp_min(_MIN_EXP)
    inv_ulp = exp2_int(_MANT_BITS - e)
    ulp = exp2_int(e - _MANT_BITS)
    t = v * inv_ulp
    lo = torch.floor(t)
    return (lo + (u < (t - lo)).to(v.dtype)) * ulp


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 |v| <= 448 to the nearest e4m3 value (ties to even), exactly, in fp32."""
    bits = v.abs().contiguous().view(torch.int32)
    e = (((bits >> 23) & 0xFF) - 127).clamp_min(_MIN_EXP)
    return torch.round(v * exp2_int(_MANT_BITS - e)) * exp2_int(e - _MANT_BITS)


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """Zero-pad to whole blocks and view as (R/br, br, C/bc, bc)."""
    r, c = x.shape
    br, bc = block
    rp, cp = -(-r // br) * br, -(-c // bc) * bc
    if (rp, cp) != (r, c):
        x = torch.nn.functional.pad(x, (0, cp - c, 0, rp - r))
    return x.reshape(rp // br, br, cp // bc, bc), r, c


def quantize_reference(x: torch.Tensor, block: tuple[int, int] = (32, 32), *,
                       hadamard: torch.Tensor | None = None, stochastic: bool = False,
                       generator: torch.Generator | None = None) -> BlockFp8:
    """bf16/fp32 (R x C) -> BlockFp8. ``hadamard``: normalized Q applied along C first."""
    if x.dim() != 2:
        raise ValueError("quantize expects a 2-D tensor")
    xf = x.float()
    if hadamard is not None:
        xf = apply_hadamard(xf, hadamard.float())
    xb, r, c = _blocked(xf, block)
    amax = xb.abs().amax(dim=(1, 3))
    e = pow2_scale_exponent(amax)
    v = xb * exp2_int(-e)[:, None, :, None]
    if stochastic:
        u = torch.rand(v.shape, generator=generator, device=v.device)
        v = stochastic_round_e4m3(v, u)
    else:
        v = round_e4m3(v)
    v = v + 0.0  # -0.0 -> +0.0: one byte pattern for zero
    data = v.reshape(xb.shape[0] * xb.shape[1], -1)[:r, :c].to(FP8_DTYPE)
    return BlockFp8(data.contiguous(), exp2_int(e), block)


def dequantize_reference(q: BlockFp8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """BlockFp8 -> dense tensor (data * scale blockwise)."""
    r, c = q.data.shape
    br, bc = q.block
    s = q.scale.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]
    return (q.data.float() * s).to(dtype)


def gemm_reference(a: BlockFp8, b: BlockFp8, out_dtype: torch.dtype = torch.bfloat16,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """A (M x K) @ B (K x N) on the dequantized operands, accumulated in fp32, plus ``bias``
    (N) before the one rounding to ``out_dtype``."""
    c = dequantize_reference(a) @ dequantize_reference(b)
    if bias is not None:
        c = c + bias.float()
    return c.to(out_dtype)


def rms_inv(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) per row, fp32."""
    xf = x.float()
    return torch.rsqrt(xf.pow(2).mean(dim=-1) + eps)


def rmsnorm_quantize_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                               block: tuple[int, int], *, hadamard: torch.Tensor | None = None
                               ) -> tuple[BlockFp8, torch.Tensor]:
    """RMSNorm(x) * weight quantized straight from fp32; returns (BlockFp8, rstd per row)."""
    rstd = rms_inv(x, eps)
    normed = x.float() * rstd[:, None] * weight.float()
    return quantize_reference(normed, block, hadamard=hadamard), rstd
