"""Flat blockwise FP8: a 1-D tensor as float8_e4m3fn with one fp32 scale per ``block``
consecutive elements, and back. The storage format of FP8 saved activations
(``gem_platform.train.saved_activations``).

Per block: amax = max|x| (fp32), scale = amax / 448 (1 for an all-zero block), data =
clamp(x / scale, -448, 448) rounded to nearest even. Both directions are single Triton passes
(one read, one write per element), bit-identical to the PyTorch references beside them: the
eager chain they replace made ~8 full passes over tens of GB per training step.

Special values follow the reference: a block holding a NaN gets scale 1 (its NaNs stay NaN,
its other elements are clamped to +-448); a block holding +-inf gets scale inf, so on the way
back every element of it is NaN. NaN bit patterns (sign, payload) are not compared: CUDA and
the CPU canonicalize them differently.

Both sides divide with IEEE division on every device: the reference divides by a tensor, not
a Python scalar, because PyTorch's CUDA kernels turn ``t / 448.0`` into ``t * (1 / 448.0)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.dispatch import Kernel, interpreting, resolve_kernel
from gem_kernels.fp8.quantize import hardware_cast
from gem_kernels.fp8.reference import FP8_DTYPE, FP8_MAX

BLOCKS_PER_PROG = 32  # 128-element blocks per program: a (32 x 128) tile, 8 KB of bf16
NUM_WARPS = 8
WIDE = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- references

def quantize_blocks_reference(flat: torch.Tensor, block: int = 128
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager chain the kernel replaces (a padded copy, then ~6 passes)."""
    pad = -flat.numel() % block
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(-1, block)
    amax = blocks.abs().amax(dim=1, keepdim=True).to(torch.float32)
    limit = torch.full((), FP8_MAX, dtype=torch.float32, device=flat.device)
    scale = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
    scaled = blocks.to(torch.float32).div_(scale).clamp_(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8_DTYPE).view(-1), scale


def dequantize_blocks_reference(data: torch.Tensor, scale: torch.Tensor, numel: int,
                                dtype: torch.dtype) -> torch.Tensor:
    """data * scale in fp32, cut to ``numel``, cast to ``dtype``."""
    if scale.shape[0] == 0:
        return torch.empty(0, dtype=dtype, device=data.device)
    wide = data.view(scale.shape[0], -1).to(torch.float32).mul_(scale)
    return wide.view(-1)[:numel].to(dtype)


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _round_e4m3_rne(v):
    """|v| <= 448 rounded to the e4m3 grid in fp32, to nearest even, sign (and -0) kept: the
    interpreter's cast truncates, so it gets values the cast leaves exact."""
    a = tl.abs(v)
    ev = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    inv_ulp = ((127 + 3 - ev) << 23).to(tl.float32, bitcast=True)
    ulp = ((127 - 3 + ev) << 23).to(tl.float32, bitcast=True)
    r = ((a * inv_ulp + 12582912.0) - 12582912.0) * ulp  # |a * inv_ulp| < 16: exact RNE
    sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_bf16_rne(y):
    """fp32 rounded to the bf16 grid (nearest even), NaN kept: for the interpreter's cast."""
    b = y.to(tl.int32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return tl.where(y != y, y, r.to(tl.float32, bitcast=True))


@triton.jit(do_not_specialize=["n", "nblocks"])
def _quantize_blocks_kernel(x_ptr, q_ptr, s_ptr, n, nblocks, stride, BLOCK: tl.constexpr,
                            BPP: tl.constexpr, EMULATE: tl.constexpr):
    """One (BPP x BLOCK) tile: one read of x (element i at i * stride), one write of bytes
    (``q_ptr``: uint8) and scales. Elements n.. of the last block are read as 0 (no padded
    copy of x)."""
    rows = tl.program_id(0).to(tl.int64) * BPP + tl.arange(0, BPP)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    x = tl.load(x_ptr + offs * stride, mask=offs < n, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    nans = tl.max((x != x).to(tl.int32), axis=1)  # the GPU's max drops NaNs; torch's keeps
    ok = (amax > 0) & (nans == 0)
    scale = tl.where(ok, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    y = tl.math.div_rn(x, scale[:, None])  # x / scale exactly as the reference: no reciprocal
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))  # NaN passes, as clamp_
    if EMULATE:
        y = _round_e4m3_rne(y)
    b = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    nan_bits = (((y.to(tl.int32, bitcast=True) >> 24) & 0x80) | 0x7F).to(tl.uint8)
    b = tl.where(y != y, nan_bits, b)  # torch's NaN byte: 0x7f with the sign
    tl.store(q_ptr + offs, b, mask=rows[:, None] < nblocks)
    tl.store(s_ptr + rows, scale, mask=rows < nblocks)


@triton.jit(do_not_specialize=["n"])
def _dequantize_blocks_kernel(q_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr,
                              BPP: tl.constexpr, INTERPRET: tl.constexpr):
    """One (BPP x BLOCK) tile: bytes and scales in, ``out``'s dtype out, elements < n.
    INTERPRET: the interpreter's casts widen e4m3's NaN byte to 480 and truncate to bf16."""
    rows = tl.program_id(0).to(tl.int64) * BPP + tl.arange(0, BPP)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    b = tl.load(q_ptr + offs, mask=mask, other=0)
    s = tl.load(s_ptr + rows, mask=rows * BLOCK < n, other=1.0)
    y = b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]
    if INTERPRET:
        y = tl.where((b & 0x7F) == 0x7F, float("nan"), y)
        if out_ptr.dtype.element_ty == tl.bfloat16:
            y = _round_bf16_rne(y)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- entry points

def _unsupported(t: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot run on ``t`` (None when they can)."""
    if (t.device.type == "cuda" and not interpreting()
            and not hardware_cast(t)):
        return "needs a GPU with an fp8 conversion (sm_89+)"
    return None


def _grid(nblocks: int) -> tuple[int]:
    return (max(1, triton.cdiv(nblocks, BLOCKS_PER_PROG)),)


def quantize_blocks(flat: torch.Tensor, block: int = 128, *,
                    kernel: Kernel | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat`` (1-D bf16/fp16/fp32, any length; any stride, as a saved tensor's memory order
    can flatten to a strided view) as (float8_e4m3fn bytes of length ceil(n / block) * block,
    padding zeros; fp32 scales (nblocks, 1)). ``kernel``: 'triton', 'pytorch' or None
    (Triton on CUDA, the reference elsewhere)."""
    if flat.dim() != 1 or flat.dtype not in WIDE:
        raise ValueError(f"quantize_blocks takes a 1-D {WIDE} tensor; got "
                         f"{flat.dtype} of shape {tuple(flat.shape)}")
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    which = resolve_kernel(kernel, flat, unsupported=_unsupported(flat), op="quantize_blocks")
    if which is Kernel.PYTORCH:
        return quantize_blocks_reference(flat, block)
    n = flat.numel()
    nblocks = triton.cdiv(n, block)
    data = torch.empty(nblocks * block, dtype=FP8_DTYPE, device=flat.device)
    scale = torch.empty((nblocks, 1), dtype=torch.float32, device=flat.device)
    if nblocks:
        _quantize_blocks_kernel[_grid(nblocks)](
            flat, data.view(torch.uint8), scale, n, nblocks, flat.stride(0), BLOCK=block,
            BPP=BLOCKS_PER_PROG, EMULATE=not hardware_cast(flat), num_warps=NUM_WARPS)
    return data, scale


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, numel: int,
                      dtype: torch.dtype, *, out: torch.Tensor | None = None,
                      kernel: Kernel | str | None = None) -> torch.Tensor:
    """The first ``numel`` elements of ``quantize_blocks``'s output widened to ``dtype``
    (data * scale in fp32, rounded once). ``out``: a 1-D contiguous tensor of ``numel``
    elements to write into (e.g. the saved tensor's own storage: no temporary, no copy)."""
    nblocks = scale.shape[0]
    if data.numel() % max(nblocks, 1) or numel > data.numel():
        raise ValueError(f"{data.numel()} bytes in {nblocks} blocks cannot hold {numel}")
    if out is not None and (out.dim() != 1 or not out.is_contiguous()
                            or out.numel() != numel or out.dtype != dtype):
        raise ValueError(f"out must be 1-D contiguous {dtype} of {numel} elements")
    which = resolve_kernel(kernel, data, unsupported=_unsupported(data),
                           op="dequantize_blocks")
    if which is Kernel.PYTORCH:
        wide = dequantize_blocks_reference(data, scale, numel, dtype)
        return wide if out is None else out.copy_(wide)
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=data.device)
    if numel:
        block = data.numel() // nblocks
        _dequantize_blocks_kernel[_grid(nblocks)](
            data.reshape(-1).view(torch.uint8), scale.reshape(-1), out, numel, BLOCK=block,
            BPP=BLOCKS_PER_PROG, num_warps=NUM_WARPS,
            INTERPRET=interpreting())
    return out


__all__ = ["dequantize_blocks", "dequantize_blocks_reference", "quantize_blocks",
           "quantize_blocks_reference"]
