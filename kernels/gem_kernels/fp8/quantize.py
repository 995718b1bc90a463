"""Block quantization bf16/fp32 -> float8_e4m3 + power-of-two block scales, in one Triton pass.

One program loads a (TR x TC) tile once, optionally multiplies it by the block-diagonal random
Hadamard matrix (a tensor-core dot with the exact +-1 matrix, then 1/sqrt(n)), takes each
(br x bc) block's amax, derives the scale from the amax's fp32 bits (exact, identical to the
reference), scales, rounds (to nearest even, or stochastically with Philox random numbers) and
writes fp8 bytes and scales. HBM traffic: read 2 B + write 1 B per element (+ scales).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from gem_kernels.dispatch import Kernel, interpreting, resolve_kernel
from gem_kernels.fp8.reference import (
    FP8_DTYPE,
    BlockFp8,
    quantize_reference,
    rmsnorm_quantize_reference,
    scale_shape,
)


@triton.jit
def _rotate(x, h_ptr, inv_sqrt_n, TR: tl.constexpr, TC: tl.constexpr, HB: tl.constexpr,
            HAD_FP32: tl.constexpr):
    """x (TR x TC) @ blockdiag(H) along columns, H = the exact +-1 matrix, then 1/sqrt(n)."""
    hr = tl.arange(0, HB)
    h = tl.load(h_ptr + hr[:, None] * HB + hr[None, :])
    xs = tl.reshape(x, (TR * TC // HB, HB))
    if HAD_FP32:
        y = tl.dot(xs.to(tl.float32), h.to(tl.float32), input_precision="ieee")
    else:
        y = tl.dot(xs.to(tl.bfloat16), h.to(tl.bfloat16))
    return tl.reshape(y, (TR, TC)) * inv_sqrt_n


@triton.jit
def _pow2_scales(amax):
    """(scale, 1/scale): the smallest power of two with amax / scale <= 448, from the bits."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 127)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _round_e4m3(v, rows, pid_c, C, seed, TR: tl.constexpr, TC: tl.constexpr,
                STOCHASTIC: tl.constexpr):
    """Round a scaled fp32 (TR x TC) tile (|v| <= 448) onto the e4m3 grid, in fp32 (ulp from
    the exponent bits), so the final cast is exact: identical results on the GPU, the
    interpreter and the reference."""
    vb = tl.abs(v).to(tl.int32, bitcast=True)
    ev = tl.maximum(((vb >> 23) & 0xFF) - 127, -6)
    inv_ulp = ((127 + 3 - ev) << 23).to(tl.float32, bitcast=True)
    ulp = ((127 - 3 + ev) << 23).to(tl.float32, bitcast=True)
    t = v * inv_ulp
    if STOCHASTIC:
        # one Philox call gives 4 numbers: 4 adjacent columns share an offset
        cols4 = pid_c * (TC // 4) + tl.arange(0, TC // 4)
        r0, r1, r2, r3 = tl.randint4x(seed, rows[:, None] * C + cols4[None, :])
        r = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (TR, TC))
        u = tl.random.uint_to_uniform_float(r)
        lo = tl.floor(t)
        t = lo + (u < (t - lo)).to(tl.float32)
    else:
        t = (t + 12582912.0) - 12582912.0  # round half to even (|t| < 16)
    return t * ulp + 0.0  # + 0.0 turns -0.0 into +0.0: one byte pattern for zero everywhere


@triton.jit
def _to_e4m3(v, rows, pid_c, C, seed, TR: tl.constexpr, TC: tl.constexpr,
             STOCHASTIC: tl.constexpr, HW_CAST: tl.constexpr):
    """A scaled fp32 (TR x TC) tile (|v| <= 448) as e4m3.

    Round to nearest even goes through the hardware conversion where there is one (HW_CAST:
    sm_89+, one cvt.rn.satfinite per two values): the fp32 emulation in ``_round_e4m3`` costs
    ~12 ALU operations per value, enough to make a two-output quantizer compute-bound on the
    H200. The interpreter keeps the emulation (exact there, like the reference). Stochastic
    rounding is always emulated (Hopper has no stochastic cvt); its result lies on the e4m3 grid,
    so the cast is exact. Values that round to zero become +0.0 on both paths."""
    if STOCHASTIC or not HW_CAST:
        v = _round_e4m3(v, rows, pid_c, C, seed, TR, TC, STOCHASTIC)
    else:
        v = tl.where(tl.abs(v) <= 0.0009765625, 0.0, v)  # |v| <= 2**-10 rounds to +0 (even)
    return v.to(tl.float8e4nv)


@triton.jit
def _quantize_store(xf, rows, cols, pid_r, pid_c, q_ptr, s_ptr, R, C, stride_sr, stride_sc,
                    seed, BR: tl.constexpr, BC: tl.constexpr, TR: tl.constexpr,
                    TC: tl.constexpr, STOCHASTIC: tl.constexpr, HW_CAST: tl.constexpr):
    """Quantize an fp32 (TR x TC) tile at (rows, cols) and store its bytes and block scales
    (``R``: the rows stored, padding included)."""
    x4 = tl.reshape(xf, (TR // BR, BR, TC // BC, BC))
    amax = tl.max(tl.max(tl.abs(x4), axis=3), axis=1)  # (TR/BR, TC/BC)
    scale, inv = _pow2_scales(amax)
    v = tl.reshape(x4 * inv[:, None, :, None], (TR, TC))
    b = _to_e4m3(v, rows, pid_c, C, seed, TR, TC, STOCHASTIC, HW_CAST)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], b, mask=mask)
    srows = pid_r * (TR // BR) + tl.arange(0, TR // BR)
    scols = pid_c * (TC // BC) + tl.arange(0, TC // BC)
    n_sr = (R + BR - 1) // BR
    n_sc = (C + BC - 1) // BC
    smask = (srows[:, None] < n_sr) & (scols[None, :] < n_sc)
    tl.store(s_ptr + srows[:, None] * stride_sr + scols[None, :] * stride_sc, scale, mask=smask)


@triton.jit(do_not_specialize=["R", "RS"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, h_ptr, R, RS, C, stride_xr, stride_xc, stride_sr,
                     stride_sc, seed, inv_sqrt_n, R_BUCKET, BR: tl.constexpr, BC: tl.constexpr,
                     TR: tl.constexpr, TC: tl.constexpr, HB: tl.constexpr,
                     HAD_FP32: tl.constexpr, STOCHASTIC: tl.constexpr, HW_CAST: tl.constexpr):
    # R_BUCKET (the row count rounded up to a power of two) exists for the autotuner's key
    # only: a jagged batch has a new token count every step, and keyed on the exact count the
    # tuner benchmarked every tile again at every step (an FP8 training step of the H200
    # recipe ran ~40x slower than bf16).
    # Rows R..RS are the padding a cuBLAS operand needs: quantized as zero rows here, so no
    # separate fill kernels run.
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * TR + tl.arange(0, TR)
    cols = pid_c * TC + tl.arange(0, TC)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :] * stride_xc,
                mask=mask, other=0.0)
    if HB > 0:
        xf = _rotate(x, h_ptr, inv_sqrt_n, TR, TC, HB, HAD_FP32)
    else:
        xf = x.to(tl.float32)
    _quantize_store(xf, rows, cols, pid_r, pid_c, q_ptr, s_ptr, RS, C, stride_sr, stride_sc,
                    seed, BR, BC, TR, TC, STOCHASTIC, HW_CAST)


@triton.jit(do_not_specialize=["R", "RS"])
def _rmsnorm_quantize_kernel(x_ptr, w_ptr, q_ptr, s_ptr, rstd_ptr, h_ptr, R, RS, C, stride_xr,
                             stride_sr, stride_sc, eps, inv_sqrt_n, BR: tl.constexpr,
                             BC: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
                             HB: tl.constexpr, HAD_FP32: tl.constexpr, HW_CAST: tl.constexpr):
    """RMSNorm fused with quantization: one program owns TR whole rows. Pass 1 sums squares,
    pass 2 re-reads the rows (from L2), normalizes, scales by the norm weight, rotates and
    quantizes. HBM: read x once, write fp8 once; the bf16 normalized tensor never exists.
    Rows R..RS (a cuBLAS operand's padding) are stored as quantized zeros."""
    pid_r = tl.program_id(0)
    rows = pid_r * TR + tl.arange(0, TR)
    row_ok = rows < R
    ssq = tl.zeros((TR,), dtype=tl.float32)
    for c0 in range(0, C, TC):
        cols = c0 + tl.arange(0, TC)
        m = row_ok[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask=m,
                    other=0.0).to(tl.float32)
        ssq += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(ssq / C + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    for c0 in range(0, C, TC):
        cols = c0 + tl.arange(0, TC)
        m = row_ok[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask=m,
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
        xf = x * rstd[:, None] * w[None, :]
        if HB > 0:
            xf = _rotate(xf, h_ptr, inv_sqrt_n, TR, TC, HB, HAD_FP32)
        _quantize_store(xf, rows, cols, pid_r, c0 // TC, q_ptr, s_ptr, RS, C, stride_sr,
                        stride_sc, 0, BR, BC, TR, TC, False, HW_CAST)


@triton.jit(do_not_specialize=["R", "RS", "RT"])
def _quantize_dual_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, R, RS, RT, C, stride_xr,
                          stride_xc, stride_sr, stride_sc, stride_str, stride_stc, seed,
                          STOCHASTIC: tl.constexpr, HW_CAST: tl.constexpr):
    """One read of a 128 x 128 tile, two FP8 outputs: x in 1x128 blocks along rows, and x^T
    (written row-major) in 1x128 blocks along x's rows, i.e. the operand of a product that
    reduces over x's rows (the weight gradient dW = dY^T X reduces over tokens).

    Rows R..RS of x's copy are the padding a cuBLAS operand needs, and x^T's columns R..RT
    pad its reduction dimension to whole 128-blocks (a jagged batch's token count is
    arbitrary); both are stored as quantized zeros, which add nothing to a product.
    The x^T copy is scaled and rounded in x's own layout (its blocks are the tile's columns:
    column amax, one scale per column) and only the 1-byte result is transposed on the way
    out, not the fp32 tile. How fast it runs and what was tried: fp8/DESIGN.md."""
    T: tl.constexpr = 128
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * T + tl.arange(0, T)
    cols = pid_c * T + tl.arange(0, T)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    xf = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :] * stride_xc,
                 mask=mask, other=0.0).to(tl.float32)
    _quantize_store(xf, rows, cols, pid_r, pid_c, q_ptr, s_ptr, RS, C, stride_sr, stride_sc,
                    seed, 1, T, T, T, STOCHASTIC, HW_CAST)
    scale_t, inv_t = _pow2_scales(tl.max(tl.abs(xf), axis=0))  # one per column of the tile
    bt = tl.trans(_to_e4m3(xf * inv_t[None, :], rows, pid_c, C, seed + 1, T, T, STOCHASTIC,
                           HW_CAST))  # (cols, rows): x^T's tile, 1 byte each
    tl.store(qt_ptr + cols[:, None].to(tl.int64) * RT + rows[None, :], bt,
             mask=(cols[:, None] < C) & (rows[None, :] < RT))
    tl.store(st_ptr + cols * stride_str + pid_r * stride_stc, scale_t, mask=cols < C)


def hardware_cast(x: torch.Tensor, wanted: bool | None = None) -> bool:
    """Whether to round through the hardware fp32 -> e4m3 conversion: only on a GPU that has
    one (sm_89+) outside the interpreter (whose cast does not round to nearest even), and not
    when the caller asks for the emulation (``wanted=False``, for comparisons)."""
    able = (x.device.type == "cuda" and not interpreting()
            and _fp8_convert_in_hardware(x.device.index or 0))
    return able and wanted is not False


@functools.cache
def _fp8_convert_in_hardware(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


# Warps per 128 x 128 tile (the transpose goes through shared memory); keyed on the column
# count only, so new token counts reuse the choice.
_quantize_dual_autotuned = triton.autotune(
    configs=[triton.Config({}, num_warps=w) for w in (4, 8, 16)],
    key=["C", "STOCHASTIC", "HW_CAST"])(_quantize_dual_kernel)


def quantize_dual(x: torch.Tensor, *, stochastic: bool = False, seed: int | None = None,
                  kernel: Kernel | str | None = None, hw_cast: bool | None = None
                  ) -> tuple[BlockFp8, BlockFp8]:
    """x (R x C) quantized twice in one pass: (x in 1x128 blocks, x^T in 1x128 blocks), both
    with column-major scales (cuBLAS blockwise layout). Equals ``quantize(x, (1, 128))`` and
    ``quantize(x.t(), (1, 128))`` (stochastic streams aside) at one read of x instead of two,
    except that x^T comes as (C x RT), RT = R rounded up to 128, its columns R..RT zeros: the
    operand of a GEMM that reduces over R needs whole 128-blocks along R (``tokens_padded``
    gives RT), and zero columns add nothing to it. x's copy is in row-padded storage
    (``padded_gemm_operand``). ``hw_cast``: round through the hardware conversion (default:
    where the GPU has one); the bytes are the same either way, False keeps the fp32 emulation
    for comparison."""
    if x.dim() != 2:
        raise ValueError(f"quantize_dual expects a 2-D tensor; got shape {tuple(x.shape)}")
    if seed is None and stochastic:
        seed = int(torch.randint(0, 2**31 - 2, (1,)).item())
    which = resolve_kernel(kernel, x)
    r, c = x.shape
    rt = tokens_padded(r)
    if which is Kernel.PYTORCH:
        out = []
        for i, t in enumerate((x, torch.nn.functional.pad(x, (0, 0, 0, rt - r)).t())):
            g = (torch.Generator(device=x.device).manual_seed(int(seed) + i) if stochastic
                 else None)
            out.append(quantize_reference(t, (1, 128), stochastic=stochastic, generator=g))
        return out[0], out[1]
    q, s = padded_gemm_operand(r, c, (1, 128), x.device, fill=False)
    qt = torch.empty((c, rt), dtype=FP8_DTYPE, device=x.device)
    st = torch.empty((rt // 128, c), dtype=torch.float32, device=x.device).t()
    grid = (rt // 128, triton.cdiv(c, 128))
    args = (x, q, s, qt, st, r, padded_rows(r), rt, c, x.stride(0), x.stride(1), s.stride(0),
            s.stride(1), st.stride(0), st.stride(1), seed or 0)
    hw = hardware_cast(x, hw_cast)
    if interpreting() or x.device.type != "cuda":
        _quantize_dual_kernel[grid](*args, STOCHASTIC=stochastic, HW_CAST=hw, num_warps=4)
    else:
        _quantize_dual_autotuned[grid](*args, STOCHASTIC=stochastic, HW_CAST=hw)
    return BlockFp8(q, s, (1, 128)), BlockFp8(qt, st, (1, 128))


def tokens_padded(rows: int) -> int:
    """``rows`` rounded up to whole 128-blocks: the reduction extent of quantize_dual's x^T."""
    return -(-rows // 128) * 128


def _prune(configs, named_args, **kwargs):
    """Keep tiles made of whole blocks (and whole Hadamard blocks)."""
    a = {**named_args, **kwargs}
    br, bc, hb = a["BR"], a["BC"], a["HB"]
    ok = [c for c in configs if c.kwargs["TR"] % br == 0 and c.kwargs["TC"] % bc == 0
          and (hb == 0 or c.kwargs["TC"] % hb == 0)]
    return ok or [triton.Config({"TR": max(br, 32), "TC": max(bc, 128)}, num_warps=8)]


_TILES = [triton.Config({"TR": tr, "TC": tc}, num_warps=w)
          for tr, tc, w in ((32, 128, 4), (64, 128, 4), (64, 128, 8), (128, 128, 8),
                            (32, 256, 4), (16, 256, 4))]
_quantize_autotuned = triton.autotune(
    configs=_TILES, key=["R_BUCKET", "C", "BR", "BC", "HB", "STOCHASTIC", "HW_CAST"],
    prune_configs_by={"early_config_prune": _prune})(_quantize_kernel)


GEMM_ROW_ALIGN = 16  # rows of a cuBLAS blockwise FP8 operand (token counts are arbitrary)


def padded_gemm_operand(rows: int, cols: int, block: tuple[int, int], device: torch.device,
                        fill: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 bytes, column-major scales) for ``rows`` rows, as views of storage holding
    ``rows`` rounded up to GEMM_ROW_ALIGN: cuBLAS's blockwise FP8 GEMM rejects a row count
    (a jagged batch's token count) its scale layout cannot align, and the padding lets the
    GEMM run on the padded extent without copying the operand. Scales are per row (1 x N
    blocks), as that GEMM's activation operand has. ``fill``: pad rows hold zeros with scale 1
    (for a copy into the storage); the quantizers write their own (zero rows, quantized), so
    they pass False and no fill kernels run."""
    if block[0] != 1:
        raise ValueError(f"a blockwise GEMM's row-padded operand has 1xN blocks, not {block}")
    rp = padded_rows(rows)
    sc = -(-cols // block[1])
    q = torch.empty((rp, cols), dtype=FP8_DTYPE, device=device)
    s = torch.empty((sc, rp), dtype=torch.float32, device=device).t()
    if fill and rp > rows:
        q[rows:].view(torch.uint8).zero_()
        s[rows:].fill_(1.0)
    return q[:rows], s[:rows]


def padded_rows(rows: int) -> int:
    """Rows of a cuBLAS blockwise operand's storage: ``rows`` rounded up to GEMM_ROW_ALIGN."""
    return -(-rows // GEMM_ROW_ALIGN) * GEMM_ROW_ALIGN


def _outputs(x: torch.Tensor, block: tuple[int, int], col_major: bool
             ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(fp8 bytes, one fp32 scale per block, rows to store) to quantize ``x`` into.
    ``col_major``: the operand of cuBLAS's blockwise GEMM (1xN blocks), in row-padded storage
    (padded_gemm_operand) whose padding the kernel writes."""
    r, c = x.shape
    if col_major:
        return (*padded_gemm_operand(r, c, block, x.device, fill=False), padded_rows(r))
    sr, sc = scale_shape(r, c, block)
    return (torch.empty((r, c), dtype=FP8_DTYPE, device=x.device),
            torch.empty((sr, sc), dtype=torch.float32, device=x.device), r)


def _hadamard_operand(x: torch.Tensor, hadamard: torch.Tensor | None
                      ) -> tuple[int, torch.Tensor, float]:
    """(block size, +-1 sign matrix, 1/sqrt(n)) for the kernels' fused rotation; block size 0
    and ``x`` as a placeholder pointer when there is no rotation."""
    if hadamard is None:
        return 0, x, 1.0
    hb = hadamard.shape[0]
    if x.shape[1] % hb:
        raise ValueError(f"columns {x.shape[1]} must be a multiple of the hadamard block {hb}")
    signs = torch.sign(hadamard).to(device=x.device, dtype=torch.float32).contiguous()
    return hb, signs, 1.0 / math.sqrt(hb)


def quantize_triton(x: torch.Tensor, block: tuple[int, int], *, hadamard: torch.Tensor | None,
                    stochastic: bool, seed: int, scale_col_major: bool = False,
                    hw_cast: bool | None = None) -> BlockFp8:
    """``scale_col_major``: write the scales column-major (the layout cuBLAS blockwise wants
    for 1x128 activation scales), returned as a strided view of the same logical shape, in
    row-padded storage (``padded_gemm_operand``). ``hw_cast``: as in :func:`quantize_dual`."""
    q, s, rs = _outputs(x, block, scale_col_major)
    _launch_quantize(x, q, s, rs, block, hadamard, stochastic, seed, hw_cast)
    return BlockFp8(q, s, block)


def _launch_quantize(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, rs: int,
                     block: tuple[int, int], hadamard: torch.Tensor | None, stochastic: bool,
                     seed: int, hw_cast: bool | None) -> None:
    """Run the quantizer over ``x`` (any strides) into ``q``/``s`` (``rs`` rows stored,
    padding included; ``s`` at any strides)."""
    r, c = x.shape
    br, bc = block
    hb, h, inv_sqrt_n = _hadamard_operand(x, hadamard)
    interpret = interpreting()
    had_fp32 = interpret or x.dtype != torch.bfloat16
    args = (x, q, s, h, r, rs, c, x.stride(0), x.stride(1), s.stride(0), s.stride(1), seed,
            inv_sqrt_n, triton.next_power_of_2(rs))
    flags = dict(BR=br, BC=bc, HB=hb, HAD_FP32=had_fp32, STOCHASTIC=stochastic,
                 HW_CAST=hardware_cast(x, hw_cast))
    if interpret or x.device.type != "cuda":
        tr, tc = max(br, 32), max(bc, 128, hb)
        grid = (triton.cdiv(rs, tr), triton.cdiv(c, tc))
        _quantize_kernel[grid](*args, TR=tr, TC=tc, **flags, num_warps=4)
    else:
        grid = lambda meta: (triton.cdiv(rs, meta["TR"]), triton.cdiv(c, meta["TC"]))
        _quantize_autotuned[grid](*args, **flags)


def _aligned_scales(rows: int, cols: int, align: int, device: torch.device) -> torch.Tensor:
    """A (rows x cols) fp32 view with row stride ``cols`` rounded up to ``align``; the padding
    columns are zeros (cuBLAS's 128x128 weight scales want a leading dimension divisible by
    4)."""
    ld = -(-cols // align) * align
    make = torch.zeros if ld > cols else torch.empty
    return make((rows, ld), dtype=torch.float32, device=device)[:, :cols]


def quantize_operand_pair(w: torch.Tensor, block: tuple[int, int], *,
                          hadamard: torch.Tensor | None = None,
                          kernel: Kernel | str | None = None, scale_align: int = 1
                          ) -> tuple[BlockFp8, BlockFp8]:
    """A weight (R x C) in square blocks, laid out for both of its GEMMs: (W, W again with
    its bytes stored transposed). The first is the forward's operand (read transposed, so its
    reduction dimension C is contiguous); the second is the input gradient's (dY W reduces
    over R, and Hopper's fp8 MMA wants that dimension contiguous). Square blocks: the second
    is the quantizer run over W's transposed view, which gives the same bytes and scales.
    ``scale_align``: each copy's scales are stored with the leading dimension its GEMM reads
    rounded up to this (4 for cuBLAS's 128x128 blocks), so neither is re-laid-out per call.
    Two quantizer launches replace a quantization, a byte transpose and two scale copies."""
    if block[0] != block[1]:
        raise ValueError(f"an operand pair needs square blocks, not {block}")
    which = resolve_kernel(kernel, w)
    if which is Kernel.PYTORCH:
        wq = quantize_reference(w, block, hadamard=hadamard)
        return wq, wq.k_major()
    if hadamard is not None:  # the rotation is along W's columns: the transposed view can't
        wq = quantize_triton(w, block, hadamard=hadamard, stochastic=False, seed=0)
        return wq, wq.k_major()
    r, c = w.shape
    sr, sc = scale_shape(r, c, block)
    q = torch.empty((r, c), dtype=FP8_DTYPE, device=w.device)
    qt = torch.empty((c, r), dtype=FP8_DTYPE, device=w.device)
    s = _aligned_scales(sr, sc, scale_align, w.device)  # (sr, sc), row stride >= sc
    st = _aligned_scales(sc, sr, scale_align, w.device)  # (sc, sr), row stride >= sr
    _launch_quantize(w, q, s, r, block, None, False, 0, None)
    _launch_quantize(w.t(), qt, st, c, block, None, False, 0, None)
    return BlockFp8(q, s, block), BlockFp8(qt.t(), st.t(), block)


def quantize(x: torch.Tensor, block: tuple[int, int] = (32, 32), *,
             hadamard: torch.Tensor | None = None, stochastic: bool = False,
             seed: int | None = None, kernel: Kernel | str | None = None,
             scale_col_major: bool = False) -> BlockFp8:
    """Quantize a 2-D tensor to block-scaled FP8 (see :mod:`gem_kernels.fp8.reference`).

    ``hadamard``: the normalized (n x n) matrix from ``hadamard_matrix`` applied along columns
    before quantizing. ``stochastic``: unbiased stochastic rounding; ``seed`` picks the random
    stream (drawn from torch's CPU generator when None).
    """
    if seed is None and stochastic:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    which = resolve_kernel(kernel, x)
    if which is Kernel.PYTORCH:
        g = None
        if stochastic:
            g = torch.Generator(device=x.device).manual_seed(int(seed))
        return quantize_reference(x, block, hadamard=hadamard, stochastic=stochastic, generator=g)
    return quantize_triton(x, block, hadamard=hadamard, stochastic=stochastic, seed=seed or 0,
                           scale_col_major=scale_col_major)


def rmsnorm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                     block: tuple[int, int] = (1, 128), *, hadamard: torch.Tensor | None = None,
                     kernel: Kernel | str | None = None, scale_col_major: bool = False
                     ) -> tuple[BlockFp8, torch.Tensor]:
    """RMSNorm(x) * weight, quantized in the same pass (the producer-fused activation
    quantization): returns (BlockFp8 of the normalized rows, rstd per row, fp32)."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError("rmsnorm_quantize expects x (rows, cols) and weight (cols,)")
    which = resolve_kernel(kernel, x, weight)
    if which is Kernel.PYTORCH:
        return rmsnorm_quantize_reference(x, weight, eps, block, hadamard=hadamard)
    x = x if x.stride(1) == 1 else x.contiguous()
    r, c = x.shape
    br, bc = block
    q, s, rs = _outputs(x, block, scale_col_major)
    rstd = torch.empty((r,), dtype=torch.float32, device=x.device)
    hb, h, inv_sqrt_n = _hadamard_operand(x, hadamard)
    interpret = interpreting()
    tr, tc = max(br, 32), max(bc, 128, hb)
    _rmsnorm_quantize_kernel[(triton.cdiv(rs, tr),)](
        x, weight, q, s, rstd, h, r, rs, c, x.stride(0), s.stride(0), s.stride(1), eps, inv_sqrt_n,
        BR=br, BC=bc, TR=tr, TC=tc, HB=hb, HAD_FP32=interpret or x.dtype != torch.bfloat16,
        HW_CAST=hardware_cast(x),
        num_warps=4 if tr * tc <= 64 * 128 else 8)
    return BlockFp8(q, s, block), rstd
