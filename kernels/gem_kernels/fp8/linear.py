"""``Fp8BlockLinear``: a linear layer whose forward and input-gradient GEMMs run in FP8.

Two routes (``block``):
- 32: GEM's square 32x32 blocks for activations, weights and output gradients; our Triton
  quantizer and Triton GEMM. Square blocks survive transposition: the backward uses the same
  bytes and scales as the forward, transposed.
- 128: activations and output gradients in 1x128 blocks, weights in 128x128 blocks, GEMMs
  through cuBLAS blockwise scaled_mm (``torch.nn.functional.scaled_mm``, Hopper). The weight's
  128x128 blocks are reused transposed for the input gradient.
In both, the weight's transposed copy is laid out K-major for Hopper's fp8 MMA by running the
quantizer over the weight's transposed view (identical values, written in the other order),
and its scales are stored where cuBLAS reads them, so a call makes no copies. The bias is added
in the GEMM's epilogue (the Triton GEMM's, or scaled_mm's for a bf16 output), and the padding
rows a cuBLAS operand needs are written by the quantizer: a layer's forward is the weight's two
quantizations, the activation's and the GEMM (plus autocast's casts, as for nn.Linear).

Weight gradient: bf16 by default (GEM keeps it out of low precision). ``wgrad='fp8'``: block 32
computes it from the same 32x32 FP8 gradient and activation (and then the layer saves only the
FP8 activation for the backward: half the bytes of bf16); block 128 needs the gradient and the
activation in 1x128 blocks along tokens too: each is quantized once into both layouts in one
pass (``quantize_dual``, whose token-major copy is zero-padded to whole 128-blocks, so any
token count works; the layer then saves the FP8 x^T, not bf16 x). With Hadamard the rotated
activation has no token-major copy: the weight gradient is FP8 only when tokens % 128 == 0
(x^T quantized separately), else bf16.

Hadamard: the same random orthogonal Q rotates the reduction dimension (in_features) of the
activation and of the weight, so (X Q)(W Q)^T = X W^T. The input gradient then comes out
rotated, dY (W Q) = dX Q, and is rotated back with Q^T (a small block-diagonal bf16 matmul).
Stochastic rounding applies to the output-gradient quantization; forward operands round to
nearest.

Without CUDA the same arithmetic runs on the PyTorch reference (quantize/dequantize emulated in
fp32), so CPU training with FP8 layers works and matches the GPU numerics up to summation order.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gem_kernels.dispatch import Kernel, autocast_dtype, resolve_kernel
from gem_kernels.fp8.gemm import gemm
from gem_kernels.fp8.quantize import (
    GEMM_ROW_ALIGN,
    padded_gemm_operand,
    quantize,
    quantize_dual,
    quantize_operand_pair,
)
from gem_kernels.fp8.reference import BlockFp8, apply_hadamard, gemm_reference, hadamard_matrix
from gem_kernels.fp8.tensor import Fp8BlockWeight


@dataclass(frozen=True)
class Fp8Config:
    """What an FP8 linear layer does; mirrors the recipe's precision section.

    ``block``: 32 (32x32 blocks, the Triton GEMM) or 128 (the default: the cuBLAS blockwise
    route, much faster on Hopper; fp8/DESIGN.md has the figures).
    """

    block: int = 128
    hadamard: bool = False
    hadamard_block: int = 128
    stochastic_rounding: bool = False
    wgrad: str = "bf16"  # "bf16" or "fp8"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block not in (32, 128):
            raise ValueError(f"block must be 32 or 128, got {self.block}")
        if self.wgrad not in ("bf16", "fp8"):
            raise ValueError(f"wgrad must be 'bf16' or 'fp8', got {self.wgrad!r}")
        hb = self.hadamard_block
        if self.hadamard and (hb < 32 or hb > 128 or hb & (hb - 1)):
            raise ValueError(f"hadamard_block must be 32, 64 or 128, got {hb}")

    @property
    def weight_block(self) -> tuple[int, int]:
        return (32, 32) if self.block == 32 else (128, 128)

    @property
    def act_block(self) -> tuple[int, int]:
        return (32, 32) if self.block == 32 else (1, 128)

    def supports(self, in_features: int, out_features: int) -> bool:
        """Whether a layer of this shape can run in this configuration."""
        if in_features % self.block or out_features % 16:
            return False
        return not self.hadamard or in_features % self.hadamard_block == 0


@functools.lru_cache(maxsize=32)
def _hadamard_cached(n: int, seed: int, device: str) -> torch.Tensor:
    return hadamard_matrix(n, seed, device=device)


def hadamard_for(cfg: Fp8Config, device: torch.device) -> torch.Tensor | None:
    """The normalized Q this configuration rotates with (None without Hadamard)."""
    if not cfg.hadamard:
        return None
    return _hadamard_cached(cfg.hadamard_block, cfg.seed, str(device))


def quantize_weight(w: torch.Tensor, cfg: Fp8Config, kernel: Kernel | str | None = None
                    ) -> BlockFp8:
    """The (out x in) weight in the configuration's weight blocks (rotated if Hadamard)."""
    return quantize(w.detach(), cfg.weight_block, hadamard=hadamard_for(cfg, w.device),
                    kernel=kernel)


def quantize_weight_operands(w: torch.Tensor, cfg: Fp8Config, kernel: Kernel
                             ) -> tuple[BlockFp8, BlockFp8]:
    """The weight as quantize_weight gives it, plus its K-major copy for the input gradient
    (``quantize_operand_pair``), with scales already in the layout each GEMM reads."""
    return quantize_operand_pair(w.detach(), cfg.weight_block,
                                 hadamard=hadamard_for(cfg, w.device), kernel=kernel,
                                 scale_align=4 if cfg.block == 128 else 1)


def _col_major(s: torch.Tensor) -> torch.Tensor:
    """The same 2-D tensor with stride (1, rows) (copies only if it is not already so)."""
    if s.stride(0) == 1 and (s.shape[1] == 1 or s.stride(1) == s.shape[0]):
        return s
    return s.t().contiguous().t()


def _scaled_mm_blockwise(a: BlockFp8, b: BlockFp8, out_dtype: torch.dtype,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """cuBLAS blockwise FP8 (Hopper): a (M x K, 1x128 blocks) @ b (K x N, 128x128 blocks, or
    1x128 blocks along K, i.e. per column), plus ``bias`` in the GEMM's epilogue."""
    sm = getattr(F, "scaled_mm", None)
    if sm is None:
        raise RuntimeError("block=128 needs torch.nn.functional.scaled_mm (torch >= 2.10)")
    st = F.ScalingType
    m = a.data.shape[0]
    a_data, scale_a = _rows_aligned(a)  # (Mp, K) and (Mp, K/128) with stride (1, Mp)
    b_data = b.data if b.data.t().is_contiguous() else b.data.t().contiguous().t()
    if b.block == (128, 1):  # per-column 1x128 along K: scales (N, K/128), stride (1, N)
        return _with_bias(sm, bias, a_data, b_data, scale_a, st.BlockWise1x128,
                          _col_major(b.scale.t()), st.BlockWise1x128, out_dtype)[:m]
    return _with_bias(sm, bias, a_data, b_data, scale_a, st.BlockWise1x128,
                      _weight_scales(b.scale), st.BlockWise128x128, out_dtype)[:m]


def _weight_scales(scale: torch.Tensor) -> torch.Tensor:
    """A 128x128-block operand's (K/128 x N/128) scales as cuBLAS reads them: (L4 x N/128) with
    stride (1, L4), L4 = K/128 rounded up to 4, padding zeros. In place when the quantizer
    stored them so (``quantize_operand_pair``), else copied."""
    kb, nb = scale.shape
    l4 = -(-kb // 4) * 4
    if (scale.stride() == (1, l4) and nb > 0 and l4 > 0
            and scale.untyped_storage().nbytes() >= 4 * (scale.storage_offset() + l4 * nb)):
        return scale.as_strided((l4, nb), (1, l4))
    sb = torch.zeros((nb, l4), dtype=torch.float32, device=scale.device)
    sb[:, :kb] = scale.t()
    return sb.t()


_BIAS_IN_GEMM: dict[str, bool] = {}  # per scaling recipe: does scaled_mm take a bias here?


def _with_bias(sm, bias: torch.Tensor | None, a_data: torch.Tensor, b_data: torch.Tensor,
               scale_a: torch.Tensor, recipe_a, scale_b: torch.Tensor, recipe_b,
               out_dtype: torch.dtype) -> torch.Tensor:
    """scaled_mm with the bias added in its epilogue (one pass over the output fewer) where
    this torch/cuBLAS accepts a bias for the recipe; else added after. torch 2.11 refuses a
    bias with an fp32 output (ValueError), so that is never tried; other refusals are learned
    on first use."""
    key = f"{recipe_a}/{recipe_b}/{out_dtype}"
    if bias is not None and out_dtype != torch.float32 and _BIAS_IN_GEMM.get(key, True):
        try:
            y = sm(a_data, b_data, scale_a, recipe_a, scale_b, recipe_b,
                   bias=bias.to(out_dtype), output_dtype=out_dtype)
            _BIAS_IN_GEMM[key] = True
            return y
        except (RuntimeError, ValueError):
            _BIAS_IN_GEMM[key] = False
    y = sm(a_data, b_data, scale_a, recipe_a, scale_b, recipe_b, output_dtype=out_dtype)
    return y if bias is None else y + bias.to(out_dtype)


def _rows_aligned(a: BlockFp8) -> tuple[torch.Tensor, torch.Tensor]:
    """a's bytes and column-major scales over its rows rounded up to GEMM_ROW_ALIGN: in place
    when a was quantized into padded storage (``quantize(..., scale_col_major=True)``),
    else copied into zero-padded buffers."""
    m, k = a.data.shape
    mp = -(-m // GEMM_ROW_ALIGN) * GEMM_ROW_ALIGN
    kb = a.scale.shape[1]
    data, scale = a.data, a.scale
    if (data.stride() == (k, 1) and scale.stride() == (1, mp)
            and data.untyped_storage().nbytes() >= (data.storage_offset() + mp * k)
            and scale.untyped_storage().nbytes() >= 4 * (scale.storage_offset() + mp * kb)):
        return data.as_strided((mp, k), (k, 1)), scale.as_strided((mp, kb), (1, mp))
    pd, ps = padded_gemm_operand(m, k, a.block, data.device)
    pd.copy_(data)
    ps.copy_(scale)
    return _rows_aligned(BlockFp8(pd, ps, a.block))


def fp8_matmul(a: BlockFp8, b: BlockFp8, out_dtype: torch.dtype, kernel: Kernel,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """A @ B (+ bias, added to the fp32 accumulator) for either route; the reference where no
    GPU kernel runs."""
    if kernel is Kernel.PYTORCH:
        return gemm_reference(a, b, out_dtype, bias=bias)
    if a.block == (32, 32):
        return gemm(a, b, out_dtype, kernel=kernel, bias=bias)
    if a.block != (1, 128) or b.block not in ((128, 128), (128, 1)):
        raise ValueError(f"no FP8 GEMM for blocks {a.block} x {b.block}")
    if a.data.device.type != "cuda":  # interpreter runs: no cuBLAS on CPU
        return gemm_reference(a, b, out_dtype, bias=bias)
    return _scaled_mm_blockwise(a, b, out_dtype, bias)


def input_grad(gq: BlockFp8, wk: BlockFp8, q: torch.Tensor | None, dtype: torch.dtype,
               kernel: Kernel) -> torch.Tensor:
    """dX = dY W from the FP8 gradient and the weight's K-major operand (``layer_weight``);
    un-rotated."""
    dx = fp8_matmul(gq, wk, dtype, kernel)
    return apply_hadamard(dx, q.t()) if q is not None else dx


def weight_grad(grad: torch.Tensor, gq: BlockFp8, x: torch.Tensor | None,
                xq: BlockFp8 | None, cfg: Fp8Config, kernel: Kernel,
                q: torch.Tensor | None, gt: BlockFp8 | None = None,
                xt: BlockFp8 | None = None) -> torch.Tensor:
    """dW = dY^T X: bf16 from ``x``, or FP8 per ``cfg.wgrad`` (block 32 from the saved 32x32
    ``xq``; block 128 from 1x128 quantizations along tokens: ``gt`` and ``xt`` when the caller
    has both from dual quantizations (any token count), else quantized here when
    tokens % 128 == 0, else bf16)."""
    if cfg.wgrad == "fp8" and cfg.block == 32 and xq is not None:
        gt = gq.t()
        gt = BlockFp8(gt.data.contiguous(), gt.scale, gt.block)
        dw = fp8_matmul(gt, xq.k_major(), torch.float32, kernel)
        return apply_hadamard(dw, q.t()) if q is not None else dw
    if x is None and xt is None:
        raise ValueError("weight_grad needs the activation for this configuration")
    dual = gt is not None and xt is not None
    if cfg.wgrad == "fp8" and cfg.block == 128 and (dual or grad.shape[0] % 128 == 0):
        # 1x128 blocks along the token dimension for both operands (unrotated: the reduction
        # here is over tokens), quantized from transposed views unless already given
        if gt is None:
            gt = quantize(grad.t(), (1, 128), stochastic=cfg.stochastic_rounding,
                          kernel=kernel, scale_col_major=True)
        if xt is None:
            xt = quantize(x.t(), (1, 128), kernel=kernel, scale_col_major=True)
        return fp8_matmul(gt, xt.t(), torch.float32, kernel)
    if cfg.wgrad == "fp8":
        _warn_bf16_weight_gradient(cfg)
    return grad.t().to(x.dtype) @ x


@functools.cache
def _warn_bf16_weight_gradient(cfg: Fp8Config) -> None:
    """Say once per configuration that an FP8 weight gradient it asked for ran in bf16."""
    warnings.warn(
        f"wgrad='fp8' ({cfg}): a weight gradient ran in bf16. On the 128 route a Hadamard layer "
        "has FP8 weight gradients only when its token count is a multiple of 128; turn "
        "hadamard off (or use block 32) for FP8 weight gradients at any token count.",
        stacklevel=2)


def dual_route(cfg: Fp8Config) -> bool:
    """Whether the 128 route with an FP8 weight gradient quantizes each operand once into both
    layouts (rows for the forward/dgrad GEMM, tokens for the wgrad GEMM) in one pass."""
    return cfg.block == 128 and cfg.wgrad == "fp8"


def grad_quantize(grad: torch.Tensor, cfg: Fp8Config, kernel: Kernel, rotated: bool
                  ) -> tuple[BlockFp8, BlockFp8 | None]:
    """The output gradient in activation blocks (stochastic rounding if configured), and on
    the dual route its transpose in 1x128 blocks along tokens from the same read. A
    ``rotated`` (Hadamard) layer's activation has no token-major copy, so its weight gradient
    is FP8 only when tokens % 128 == 0 and the transpose is made only then."""
    if dual_route(cfg) and (not rotated or grad.shape[0] % 128 == 0):
        return quantize_dual(grad, stochastic=cfg.stochastic_rounding, kernel=kernel)
    return quantize(grad, cfg.act_block, stochastic=cfg.stochastic_rounding, kernel=kernel,
                    scale_col_major=cfg.block == 128), None


def layer_weight(weight: torch.Tensor, cfg: Fp8Config, kernel: Kernel
                 ) -> tuple[BlockFp8, BlockFp8]:
    """The weight in FP8 for the forward GEMM and, K-major, for the input gradient's:
    already gathered as FP8 (FSDP; the K-major copy is made here), or quantized now."""
    if isinstance(weight, Fp8BlockWeight):
        if weight.fp8.block != cfg.weight_block:
            raise ValueError(f"weight blocks {weight.fp8.block} != {cfg.weight_block}")
        return weight.fp8, weight.fp8.k_major()
    return quantize_weight_operands(weight, cfg, kernel)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                cfg: Fp8Config, kernel: Kernel) -> torch.Tensor:
        wq, wk = layer_weight(weight, cfg, kernel)
        q = hadamard_for(cfg, x.device)
        xt = None
        if q is None and dual_route(cfg):  # x^T along tokens for the wgrad too
            xq, xt = quantize_dual(x, kernel=kernel)
        else:
            xq = quantize(x, cfg.act_block, hadamard=q, kernel=kernel,
                          scale_col_major=cfg.block == 128)
        y = fp8_matmul(xq, wq.t(), x.dtype, kernel, bias=bias)
        ctx.cfg, ctx.kernel, ctx.has_bias = cfg, kernel, bias is not None
        ctx.w_dtype = weight.dtype
        # Only an FP8 activation is kept where the weight gradient is FP8 and has it: block 32
        # (the same 32x32 bytes read transposed) or the dual route (x^T in 1x128 blocks).
        ctx.fp8_act = cfg.wgrad == "fp8" and cfg.block == 32
        ctx.xt_saved = xt is not None
        if ctx.fp8_act:
            ctx.save_for_backward(wk.data, wk.scale, xq.data, xq.scale)
        elif ctx.xt_saved:
            ctx.save_for_backward(wk.data, wk.scale, xt.data, xt.scale)
        else:
            ctx.save_for_backward(wk.data, wk.scale, x)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cfg: Fp8Config = ctx.cfg
        kernel: Kernel = ctx.kernel
        saved = ctx.saved_tensors
        wk = BlockFp8(saved[0], saved[1], cfg.weight_block)
        grad = grad.contiguous()
        q = hadamard_for(cfg, grad.device)
        gq, gt = grad_quantize(grad, cfg, kernel, rotated=q is not None)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = input_grad(gq, wk, q, grad.dtype, kernel)
        if ctx.needs_input_grad[1]:
            xq = BlockFp8(saved[2], saved[3], cfg.act_block) if ctx.fp8_act else None
            xt = BlockFp8(saved[2], saved[3], (1, 128)) if ctx.xt_saved else None
            x = None if ctx.fp8_act or ctx.xt_saved else saved[2]
            dw = weight_grad(grad, gq, x, xq, cfg, kernel, q, gt=gt, xt=xt).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.sum(0)
        return dx, dw, db, None, None


@torch.compiler.disable
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     cfg: Fp8Config | None = None, *, kernel: Kernel | str | None = None
                     ) -> torch.Tensor:
    """y = x W^T + b with block-scaled FP8 GEMMs (x: (..., in), weight: (out, in)). Opaque
    to torch.compile (a graph break): a compiled region fuses the glue around it and runs the
    layer's own Triton kernels and autograd as they are."""
    cfg = cfg or Fp8Config()
    which = resolve_kernel(kernel, x)
    # As nn.Linear under autocast: the activation enters, and the output and the bf16 weight
    # gradient come out, in autocast's dtype. A norm hands its output over in fp32; kept fp32,
    # it made y fp32 (and everything downstream) and the weight gradient an fp32 GEMM on CUDA
    # cores (the H200 recipe's FP8 step: 28 of 204 ms).
    x = x.to(autocast_dtype(x) or x.dtype)
    shp = x.shape
    y = _Fp8LinearFn.apply(x.reshape(-1, shp[-1]), weight, bias, cfg, which)
    return y.reshape(*shp[:-1], y.shape[-1])


class Fp8BlockLinear(nn.Linear):
    """nn.Linear whose matmuls run in block-scaled FP8 (same parameters and state dict)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 cfg: Fp8Config | None = None, kernel: Kernel | str | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.cfg = cfg or Fp8Config()
        self.kernel = kernel

    @classmethod
    def from_linear(cls, linear: nn.Linear, cfg: Fp8Config,
                    kernel: Kernel | str | None = None) -> Fp8BlockLinear:
        """Wrap an existing layer, sharing its Parameter objects (optimizer state survives)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.cfg, new.kernel = cfg, kernel
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_block_linear(x, self.weight, self.bias, self.cfg, kernel=self.kernel)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_block={self.cfg.block}, hadamard={self.cfg.hadamard}"
