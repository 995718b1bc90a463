"""``Fp8RMSNormLinear``: RMSNorm followed by an FP8 linear layer, with the activation
quantization fused into the norm (one read of x, one FP8 write; the bf16 normalized tensor is
never written for the forward).

Backward: the output gradient is quantized once; dN = dY W in FP8 (un-rotated if Hadamard);
the RMSNorm backward runs from x and the saved 1/rms (on CUDA through aten's fused RMSNorm
backward, one pass; elsewhere in fp32 torch ops). The weight gradient uses the
normalized activation recomputed in bf16 (or the saved 32x32 FP8 activation when
``wgrad='fp8'`` with block 32).
"""

from __future__ import annotations

import torch
from torch import nn

from gem_kernels.dispatch import Kernel, autocast_dtype, resolve_kernel
from gem_kernels.fp8.linear import (
    Fp8Config,
    fp8_matmul,
    grad_quantize,
    hadamard_for,
    input_grad,
    layer_weight,
    weight_grad,
)
from gem_kernels.fp8.quantize import rmsnorm_quantize
from gem_kernels.fp8.reference import BlockFp8


class _NormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, norm_w: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, eps: float, cfg: Fp8Config, kernel: Kernel,
                out_dtype: torch.dtype) -> torch.Tensor:
        wq, wk = layer_weight(weight, cfg, kernel)
        q = hadamard_for(cfg, x.device)
        xq, rstd = rmsnorm_quantize(x, norm_w, eps, cfg.act_block, hadamard=q, kernel=kernel,
                                    scale_col_major=cfg.block == 128)
        y = fp8_matmul(xq, wq.t(), out_dtype, kernel, bias=bias)
        ctx.cfg, ctx.kernel, ctx.has_bias, ctx.w_dtype = cfg, kernel, bias is not None, weight.dtype
        ctx.eps, ctx.out_dtype = eps, out_dtype
        ctx.save_for_backward(x, rstd, norm_w, wk.data, wk.scale, xq.data, xq.scale)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cfg: Fp8Config = ctx.cfg
        kernel: Kernel = ctx.kernel
        x, rstd, norm_w, wd, ws, xd, xs = ctx.saved_tensors
        grad = grad.contiguous()
        q = hadamard_for(cfg, grad.device)
        gq, gt = grad_quantize(grad, cfg, kernel, rotated=q is not None)
        fused = x.is_cuda  # aten's fused RMSNorm kernels: one pass each instead of ~10 in fp32
        dx = dnw = dw = db = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            wk = BlockFp8(wd, ws, cfg.weight_block)
            if fused:
                dn = input_grad(gq, wk, q, x.dtype, kernel)
                dx, dnw = torch.ops.aten._fused_rms_norm_backward(
                    dn, x, [x.shape[1]], rstd[:, None], norm_w.to(x.dtype), [True, True])
                dnw = dnw.to(norm_w.dtype)
            else:
                xhat = x.float() * rstd[:, None]
                dn = input_grad(gq, wk, q, torch.float32, kernel).float()
                dnw = (dn * xhat).sum(0).to(norm_w.dtype)
                g = dn * norm_w.float()
                dx = (rstd[:, None] * (g - xhat * (g * xhat).mean(dim=1, keepdim=True)))
                dx = dx.to(x.dtype)
        if ctx.needs_input_grad[2]:
            if fused:
                normed = torch.ops.aten._fused_rms_norm(x, [x.shape[1]], norm_w.to(x.dtype),
                                                        ctx.eps)[0]
            else:
                normed = x.float() * rstd[:, None] * norm_w.float()
            normed = normed.to(ctx.out_dtype)  # the bf16 weight gradient's operand
            xq = BlockFp8(xd, xs, cfg.act_block) if cfg.block == 32 else None
            xt = None
            if gt is not None and q is None:  # the normalized activation along tokens
                from gem_kernels.fp8.quantize import quantize_dual

                xt = quantize_dual(normed, kernel=kernel)[1]
            dw = weight_grad(grad, gq, normed, xq, cfg, kernel, q, gt=gt, xt=xt).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = grad.sum(0)
        return dx, dnw, dw, db, None, None, None, None


class Fp8RMSNormLinear(nn.Module):
    """``linear(rms_norm(x))`` with the FP8 activation quantization fused into the norm.

    Holds the norm's weight and the linear's parameters (shared with the modules it was built
    from, see :meth:`from_modules`).
    """

    def __init__(self, norm_weight: nn.Parameter, eps: float | None, weight: nn.Parameter,
                 bias: nn.Parameter | None, cfg: Fp8Config,
                 kernel: Kernel | str | None = None):
        super().__init__()
        self.norm_weight, self.weight, self.bias = norm_weight, weight, bias
        self.eps, self.cfg, self.kernel = eps, cfg, kernel

    @classmethod
    def from_modules(cls, norm: nn.RMSNorm, linear: nn.Linear, cfg: Fp8Config,
                     kernel: Kernel | str | None = None) -> Fp8RMSNormLinear:
        if norm.weight is None:
            raise ValueError("the RMSNorm must have an elementwise weight")
        return cls(norm.weight, norm.eps, linear.weight, linear.bias, cfg, kernel)

    @torch.compiler.disable  # opaque to torch.compile, as fp8_block_linear
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        which = resolve_kernel(self.kernel, x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # as nn.RMSNorm
        # As norm + linear under autocast: the norm reads x in its own dtype, the linear's
        # output (and its bf16 weight gradient) is in autocast's dtype.
        out_dtype = autocast_dtype(x) or x.dtype
        shp = x.shape
        y = _NormLinearFn.apply(x.reshape(-1, shp[-1]).contiguous(), self.norm_weight,
                                self.weight, self.bias, eps, self.cfg, which, out_dtype)
        return y.reshape(*shp[:-1], y.shape[-1])
