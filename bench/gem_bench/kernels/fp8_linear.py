"""Benchmark: block-scaled FP8 linear layer (forward, backward) and the quantization kernel.

Same run, same inputs, per shape (tokens x in -> out):
- ``bf16``: torch.nn.functional.linear forward; backward dX = dY W and dW = dY^T X in bf16.
- ``rowwise_gemm``: torch._scaled_mm with rowwise FP8 scales, GEMMs only (operands quantized
  beforehand, not timed): forward X W^T, backward dX in FP8 plus dW in bf16.
- ``fp8_b32`` / ``fp8_b128``: Fp8BlockLinear, quantization included, through autograd
  (block 32: Triton quantizer + Triton GEMM; block 128: Triton quantizer + cuBLAS blockwise);
  bf16 weight gradient. ``_w8``: FP8 weight gradient too. ``_had``: Hadamard block 128.
- ``gemm_b32`` / ``gemm_b128``: our forward GEMM alone (operands pre-quantized).
- ``gemm_b128_dgrad`` / ``gemm_b128_wgrad`` / ``gemm_bf16_dgrad`` / ``gemm_bf16_wgrad``: the
  backward's two GEMMs alone (operands pre-quantized), so the best backward ratio the 128 route
  can reach, bf16 (dgrad + wgrad) / FP8 (dgrad + wgrad), is read off the same run.
- ``quant_dual``: one read, two FP8 layouts (rows and tokens), HBM bytes 2 + 1 + 1 per element.
- ``*_emul``: the same quantizer rounding through its fp32 emulation of e4m3 instead of the
  hardware conversion (same bytes), to show what the conversion instruction buys.
- ``norm_*`` (two shapes): RMSNorm + linear, bf16 vs RMSNorm then Fp8BlockLinear (unfused) vs
  Fp8RMSNormLinear (quantization fused into the norm); backward = dx, dnorm_weight, dW.
- ``quant_*``: the quantization kernel alone; HBM bytes = 2 (read bf16) + 1 (write fp8) per
  element plus scales; fraction of the measured copy ceiling.
Useful TFLOP/s count 2MKN per forward and 4MKN per backward for every variant.

Command that produced docs/bench/fp8_linear.json (on the H200):
    PYTHONPATH=kernels:platform:bench python -m gem_bench.kernels.fp8_linear --out $OUT
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable

import torch

from gem_bench.kernels.common import (
    H200_BF16_TFLOPS,
    H200_FP8_TFLOPS,
    BenchRow,
    add_ratios,
    fill_rates,
    print_table,
    time_ms,
    write_json,
)

CASES = [  # (tokens, in_features, out_features)
    (16384, 512, 512),
    (16384, 4096, 4096),
    (65536, 1024, 1024),
    (65536, 2048, 2048),
    (131072, 512, 2048),
    (131072, 4096, 4096),
]
QUICK = [(16384, 1024, 1024), (65536, 2048, 2048)]


def _rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 with fp32 scales (rows x 1)."""
    amax = t.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def _adder(case: str, rows: list[BenchRow], rep_ms: float, errors: dict):
    """A function that times one variant into ``rows``; a variant that cannot run here is
    reported in ``errors``, not fatal."""

    def add(variant: str, direction: str, fn: Callable[[], object], flops: float | None = None,
            nbytes: float | None = None, peak: float = H200_FP8_TFLOPS, **extra) -> None:
        try:
            ms = time_ms(fn, warmup_ms=25, rep_ms=rep_ms)
        except Exception as e:  # a variant that cannot run here is reported, not fatal
            errors[f"{case}/{variant}/{direction}"] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
            return
        rows.append(fill_rates(BenchRow(case, variant, direction, ms, extra=extra), flops,
                               nbytes, peak_tflops=peak))

    return add


def _case_rows(m: int, k: int, n: int, rep_ms: float, errors: dict) -> list[BenchRow]:
    dev = "cuda"
    case = f"{m}x{k}->{n}"
    torch.manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    gy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    f_fwd, f_bwd = 2.0 * m * k * n, 4.0 * m * k * n
    rows: list[BenchRow] = []
    add = _adder(case, rows, rep_ms, errors)
    _baseline_rows(add, x, gy, lin.weight, f_fwd, f_bwd)
    _layer_rows(add, (m, k, n), case, x, gy, lin, errors, f_fwd, f_bwd)
    _gemm_rows(add, x, gy, lin.weight, f_fwd)
    _quantizer_rows(add, x)
    if (m, k, n) in NORM_CASES:
        rows += _norm_rows(case, x, gy, lin, rep_ms, errors, f_fwd, f_bwd)
    return rows


def _baseline_rows(add, x: torch.Tensor, gy: torch.Tensor, w: torch.Tensor, f_fwd: float,
                   f_bwd: float) -> None:
    """bf16 nn.Linear, and torch._scaled_mm rowwise (GEMMs only)."""
    xr = x.detach().requires_grad_()
    add("bf16", "fwd", lambda: torch.nn.functional.linear(x, w), f_fwd, peak=H200_BF16_TFLOPS)
    y = torch.nn.functional.linear(xr, w)
    add("bf16", "bwd", lambda: torch.autograd.grad(y, (xr, w), gy, retain_graph=True), f_bwd,
        peak=H200_BF16_TFLOPS)
    xq, xs = _rowwise_fp8(x)
    wq, ws = _rowwise_fp8(w)  # (n, k): per output channel
    gq, gs = _rowwise_fp8(gy)
    wtq, wts = _rowwise_fp8(w.t().contiguous())  # (k, n): per input channel, for dX
    add("rowwise_gemm", "fwd", lambda: torch._scaled_mm(
        xq, wq.t(), xs, ws.t(), out_dtype=torch.bfloat16), f_fwd)

    def rowwise_bwd():
        torch._scaled_mm(gq, wtq.t(), gs, wts.t(), out_dtype=torch.bfloat16)
        return gy.t() @ x

    add("rowwise_gemm", "bwd", rowwise_bwd, f_bwd)


def _layer_rows(add, shape: tuple[int, int, int], case: str, x: torch.Tensor,
                gy: torch.Tensor, lin: torch.nn.Linear, errors: dict, f_fwd: float,
                f_bwd: float) -> None:
    """Our Fp8BlockLinear layer at each block size, with Hadamard and with an FP8 wgrad."""
    from gem_kernels.fp8 import Fp8BlockLinear, Fp8Config

    xr, w = x.detach().requires_grad_(), lin.weight
    for block, hadamard, wgrad in ((32, False, "bf16"), (128, False, "bf16"),
                                   (128, False, "fp8"), (32, False, "fp8"), (32, True, "bf16")):
        name = f"fp8_b{block}" + ("_had" if hadamard else "") + ("_w8" if wgrad == "fp8" else "")
        if hadamard and shape not in ((65536, 2048, 2048), (16384, 1024, 1024)):
            continue
        cfg = Fp8Config(block=block, hadamard=hadamard, hadamard_block=128, wgrad=wgrad)
        layer = Fp8BlockLinear.from_linear(lin, cfg)
        add(name, "fwd", lambda layer=layer: layer(x), f_fwd)
        try:
            y8 = layer(xr)
            add(name, "bwd", lambda y8=y8: torch.autograd.grad(y8, (xr, w), gy,
                                                               retain_graph=True), f_bwd)
        except Exception as e:
            errors[f"{case}/{name}/bwd"] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()


def _gemm_rows(add, x: torch.Tensor, gy: torch.Tensor, w: torch.Tensor, f_fwd: float) -> None:
    """The GEMMs alone, and the backward's parts on the 128 route: what an FP8 weight gradient
    can save at best."""
    from gem_kernels.dispatch import Kernel
    from gem_kernels.fp8 import gemm, quantize, quantize_dual
    from gem_kernels.fp8.linear import _scaled_mm_blockwise, fp8_matmul

    a32, w32 = quantize(x, (32, 32)), quantize(w, (32, 32))
    add("gemm_b32", "fwd", lambda: gemm(a32, w32.t()), f_fwd)
    a128, w128 = quantize(x, (1, 128)), quantize(w, (128, 128))
    add("gemm_b128", "fwd", lambda: _scaled_mm_blockwise(a128, w128.t(), torch.bfloat16), f_fwd)
    g128, gt128 = quantize_dual(gy)
    _, xt128 = quantize_dual(x)
    wk = quantize(w, (128, 128)).k_major()
    add("gemm_b128_dgrad", "bwd", lambda: fp8_matmul(g128, wk, torch.bfloat16,
                                                     Kernel.TRITON), f_fwd)
    add("gemm_b128_wgrad", "bwd", lambda: fp8_matmul(gt128, xt128.t(), torch.float32,
                                                     Kernel.TRITON), f_fwd)
    add("gemm_bf16_wgrad", "bwd", lambda: gy.t() @ x, f_fwd, peak=H200_BF16_TFLOPS)
    add("gemm_bf16_dgrad", "bwd", lambda: gy @ w, f_fwd, peak=H200_BF16_TFLOPS)


def _quantizer_rows(add, x: torch.Tensor) -> None:
    """The quantizer alone: block shapes, emulated cast, Hadamard, stochastic rounding, and
    the dual (row- and column-wise) quantizer."""
    from gem_kernels.fp8 import Fp8Config, quantize_dual
    from gem_kernels.fp8.linear import hadamard_for
    from gem_kernels.fp8.quantize import quantize_triton

    elems = x.numel()
    for label, block, had, sr, hw in (("quant_32", (32, 32), False, False, None),
                                      ("quant_32_emul", (32, 32), False, False, False),
                                      ("quant_1x128", (1, 128), False, False, None),
                                      ("quant_32_had128", (32, 32), True, False, None),
                                      ("quant_32_sr", (32, 32), False, True, None)):
        scales = elems / (block[0] * block[1]) * 4
        q = hadamard_for(Fp8Config(hadamard=True, hadamard_block=128), x.device) if had else None
        add(label, "fwd", lambda block=block, q=q, sr=sr, hw=hw: quantize_triton(
            x, block, hadamard=q, stochastic=sr, seed=1, hw_cast=hw), nbytes=3.0 * elems + scales)
    scales = 2 * elems / 128 * 4
    add("quant_dual", "fwd", lambda: quantize_dual(x), nbytes=4.0 * elems + scales)
    add("quant_dual_emul", "fwd", lambda: quantize_dual(x, hw_cast=False),
        nbytes=4.0 * elems + scales)
    add("quant_dual_sr", "fwd", lambda: quantize_dual(x, stochastic=True, seed=1),
        nbytes=4.0 * elems + scales)


NORM_CASES = [(65536, 2048, 2048), (16384, 4096, 4096)]


def _norm_rows(case: str, x: torch.Tensor, gy: torch.Tensor, lin: torch.nn.Linear,
               rep_ms: float, errors: dict, f_fwd: float, f_bwd: float) -> list[BenchRow]:
    """RMSNorm then the linear layer: bf16, unfused (nn.RMSNorm + Fp8BlockLinear) and fused
    (Fp8RMSNormLinear: the norm writes FP8 directly), forward and backward (dx, dnorm, dW)."""
    from gem_kernels.fp8 import Fp8BlockLinear, Fp8Config, Fp8RMSNormLinear

    k = x.shape[1]
    norm = torch.nn.RMSNorm(k, eps=1e-6, device=x.device, dtype=x.dtype)
    rows: list[BenchRow] = []
    for block, wgrad in ((128, "bf16"), (128, "fp8")):
        cfg = Fp8Config(block=block, wgrad=wgrad)
        tag = f"_b{block}" + ("_w8" if wgrad == "fp8" else "")
        fp8 = Fp8BlockLinear.from_linear(lin, cfg)
        variants = {"norm_bf16": lambda t: lin(norm(t)),
                    "norm_unfused" + tag: lambda t, fp8=fp8: fp8(norm(t)),
                    "norm_fused" + tag: Fp8RMSNormLinear.from_modules(norm, lin, cfg)}
        if wgrad == "fp8":
            variants.pop("norm_bf16")
        for name, fn in variants.items():
            try:
                ms = time_ms(lambda fn=fn: fn(x), warmup_ms=25, rep_ms=rep_ms)
                rows.append(fill_rates(BenchRow(case, name, "fwd", ms), f_fwd,
                                       peak_tflops=H200_FP8_TFLOPS))
                xr = x.detach().requires_grad_()
                y = fn(xr)
                params = (xr, norm.weight, lin.weight)
                ms = time_ms(lambda y=y, params=params: torch.autograd.grad(
                    y, params, gy, retain_graph=True), warmup_ms=25, rep_ms=rep_ms)
                rows.append(fill_rates(BenchRow(case, name, "bwd", ms), f_bwd,
                                       peak_tflops=H200_FP8_TFLOPS))
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                errors[f"{case}/{name}"] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc()
    return rows


def main(argv: list[str] | None = None) -> list[BenchRow]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="directory for fp8_linear.json")
    p.add_argument("--quick", action="store_true", help="two shapes, short timing")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the FP8 linear benchmark needs a CUDA GPU (H200)")
    cases = QUICK if args.quick else CASES
    rep = 50 if args.quick else 150
    rows: list[BenchRow] = []
    errors: dict[str, str] = {}
    meta = {"cases": cases, "errors": errors,
            "ceilings": {"bf16_tflops": H200_BF16_TFLOPS, "fp8_tflops": H200_FP8_TFLOPS},
            "note": "column frac_bf16_peak holds each row's fraction of ITS ceiling: bf16 rows "
                    "of the bf16 matmul ceiling, all FP8 rows of the FP8 tensorwise ceiling"}
    for m, k, n in cases:
        rows += _case_rows(m, k, n, rep, errors)
        torch.cuda.empty_cache()
        for ours in ("fp8_b32", "fp8_b128", "fp8_b128_w8", "fp8_b32_w8", "fp8_b32_had",
                     "rowwise_gemm", "gemm_b32", "gemm_b128"):
            add_ratios(rows, ours, "bf16")
        for ours in ("norm_unfused_b128", "norm_fused_b128", "norm_unfused_b128_w8",
                     "norm_fused_b128_w8"):
            add_ratios(rows, ours, "norm_bf16")
        path = write_json(rows, f"{args.out}/fp8_linear.json", meta)  # partial results survive
    print_table(rows, "FP8 block-scaled linear on " + torch.cuda.get_device_name())
    if errors:
        print("errors:", errors)
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
