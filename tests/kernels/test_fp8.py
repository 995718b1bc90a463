"""Block-scaled FP8: quantization, Hadamard, stochastic rounding, GEMM and the linear layer.

CPU runs use the Triton interpreter at small shapes; GPU tests (marked ``gpu``) run the same
checks at real sizes plus the cuBLAS 128-block route.
"""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():  # before triton is imported: CPU runs use the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

from gem_kernels.dispatch import resolve_kernel  # noqa: E402
from gem_kernels.fp8 import (  # noqa: E402
    BlockFp8,
    Fp8BlockLinear,
    Fp8BlockWeight,
    Fp8Config,
    Fp8RMSNormLinear,
    apply_hadamard,
    dequantize_reference,
    fp8_block_linear,
    gemm,
    gemm_reference,
    hadamard_for,
    hadamard_matrix,
    quantize,
    quantize_dual,
    quantize_reference,
    quantize_weight,
    rmsnorm_quantize,
)
from gem_kernels.fp8.gemm import gemm_triton  # noqa: E402
from gem_kernels.fp8.linear import fp8_matmul  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BLOCKS = [(32, 32), (1, 128), (128, 128)]
# e4m3 round-to-nearest: at most half an ulp = 2**-4 relative for normal values.
E4M3_HALF_ULP = 2.0**-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def _bytes(q: BlockFp8) -> torch.Tensor:
    return q.data.contiguous().view(torch.uint8)


def _close_codes(q: BlockFp8, ref: BlockFp8) -> bool:
    """Same scales, values at most one e4m3 step apart (the Hadamard dot's summation order may
    move a value across a rounding boundary)."""
    a, b = q.data.float(), ref.data.float()
    step = b.abs() * 2.0**-3 + 2.0**-9
    return torch.equal(q.scale, ref.scale) and bool(((a - b).abs() <= step).all())


def _outliers(r: int, c: int, seed: int, device: str = DEV) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) * torch.exp(torch.randn(r, 1, generator=g))
    x[torch.rand(r, c, generator=g) < 0.01] *= 50.0  # sparse outliers
    return x.to(device)


@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_matches_reference_and_error_bound(block):
    x = _outliers(70, 160, seed=1).to(torch.bfloat16)  # ragged: partial blocks on both edges
    q = quantize(x, block, kernel="triton")
    ref = quantize_reference(x, block)
    assert torch.equal(_bytes(q), _bytes(ref))
    assert torch.equal(q.scale, ref.scale)
    # scales are powers of two and nothing saturates
    assert torch.equal(torch.exp2(torch.log2(q.scale).round()), q.scale)
    assert q.data.float().abs().max() <= 448
    d = dequantize_reference(q)
    xf = x.float()
    s = q.scale.repeat_interleave(block[0], 0)[:70].repeat_interleave(block[1], 1)[:, :160]
    # normal range: relative error <= half an ulp; subnormal range: absolute <= 2**-10 * scale
    bound = torch.maximum(xf.abs() * E4M3_HALF_ULP, s * 2.0**-10)
    assert ((d - xf).abs() <= bound * (1 + 1e-6)).all()
    assert _rel(d, xf) < 0.03


def _tokens_padded_t(x: torch.Tensor) -> torch.Tensor:
    """x^T with x's rows zero-padded to whole 128-blocks: quantize_dual's second layout."""
    return torch.nn.functional.pad(x, (0, 0, 0, -x.shape[0] % 128)).t()


@pytest.mark.parametrize("shape", [(256, 128), (200, 300), (37, 128)])
def test_quantize_dual_equals_two_quantizations(shape):
    """One read, both layouts: x in 1x128 blocks and x^T in 1x128 blocks (along x's rows),
    byte-identical to quantizing x and x.t() separately; partial tiles included. x^T's rows
    (x's token dimension) come zero-padded to whole 128-blocks, for any token count."""
    x = _outliers(*shape, seed=21, device=DEV)
    q, qt = quantize_dual(x, kernel="triton")
    for got, want in ((q, quantize_reference(x, (1, 128))),
                      (qt, quantize_reference(_tokens_padded_t(x), (1, 128)))):
        assert got.block == (1, 128) and got.data.shape == want.data.shape
        assert torch.equal(_bytes(got), _bytes(want)) and torch.equal(got.scale, want.scale)
        assert got.scale.stride(0) == 1  # column-major scales: cuBLAS blockwise layout
    assert qt.data.shape == (shape[1], -(-shape[0] // 128) * 128)
    ref_q, ref_qt = quantize_dual(x, kernel="pytorch")
    assert torch.equal(_bytes(ref_q), _bytes(q)) and torch.equal(_bytes(ref_qt), _bytes(qt))
    sq, sqt = quantize_dual(x, stochastic=True, seed=3, kernel="triton")
    assert _rel(dequantize_reference(sqt).t()[:shape[0]], dequantize_reference(sq)) < 0.1


def test_zero_and_tiny_blocks_do_not_break():
    x = torch.zeros(64, 64, device=DEV)
    x[:32, :32] = 1e-30
    q = quantize(x, (32, 32), kernel="triton")
    assert torch.isfinite(q.scale).all() and torch.isfinite(q.data.float()).all()
    assert torch.equal(_bytes(q), _bytes(quantize_reference(x, (32, 32))))


def test_transpose_reuse_gives_identical_bytes():
    x = _outliers(96, 64, seed=2)
    q = quantize(x, (32, 32), kernel="triton")
    qt = quantize(x.t().contiguous(), (32, 32), kernel="triton")
    assert torch.equal(_bytes(q.t()), _bytes(qt))
    assert torch.equal(q.t().scale, qt.scale)


@pytest.mark.parametrize("n", [32, 64, 128])
def test_hadamard_is_orthogonal(n):
    q = hadamard_matrix(n, seed=7)
    assert torch.allclose(q @ q.t(), torch.eye(n), atol=1e-6)
    assert not torch.equal(hadamard_matrix(n, seed=8), q)  # seeded random signs


def test_hadamard_spreads_outliers_and_keeps_the_product():
    q = hadamard_matrix(32, seed=3, device=DEV)
    x = torch.zeros(1, 32, device=DEV)
    x[0, 0] = 8.0
    spread = apply_hadamard(x, q)
    assert torch.allclose(spread.abs(), torch.full_like(spread, 8.0 / 32**0.5))
    a, w = _outliers(64, 128, seed=4), _outliers(96, 128, seed=5)
    exact = a @ w.t()
    assert _rel(apply_hadamard(a, q) @ apply_hadamard(w, q).t(), exact) < 1e-5
    # quantized with the rotation: XW unchanged up to quantization error, and smaller error
    # than without it on outlier-heavy inputs
    xq = quantize(a, (32, 32), hadamard=q, kernel="triton")
    wq = quantize(w, (32, 32), hadamard=q, kernel="triton")
    ref = quantize_reference(a, (32, 32), hadamard=q)
    assert _close_codes(xq, ref)
    had = gemm(xq, wq.t(), torch.float32, kernel="triton")
    plain = gemm(quantize(a, kernel="triton"), quantize(w, kernel="triton").t(), torch.float32,
                 kernel="triton")
    assert _rel(had, exact) < 0.05
    assert _rel(had, exact) < _rel(plain, exact)


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = (torch.rand(32, 32) * 3 + 0.1).to(DEV)
    x[0, 0] = 3.5  # every block shares amax 3.5 -> scale 2**-7 when stacked
    n = 48
    # n copies of x stacked: one launch, independent random numbers per copy, same scales
    stacked = dequantize_reference(quantize(x.repeat(n, 1), (32, 32), stochastic=True, seed=5,
                                            kernel="triton"))
    mean = stacked.reshape(n, 32, 32).mean(0)
    rne = dequantize_reference(quantize(x, (32, 32), kernel="triton"))
    # the mean converges to x (mean |error| ~ 0.39 ulp / sqrt(n) ~ 0.05 ulp) while
    # round-to-nearest keeps its bias (mean |error| ~ 0.25 ulp)
    ulp = 2.0 ** (torch.floor(torch.log2(x / 2.0**-7)) - 3) * 2.0**-7
    assert ((mean - x).abs() / ulp).mean() < 0.08
    assert ((rne - x).abs() / ulp).mean() > 0.15
    # every sample is one of the two neighbours
    one = dequantize_reference(quantize(x, (32, 32), stochastic=True, seed=1, kernel="triton"))
    assert ((one - x).abs() <= ulp * (1 + 1e-6)).all()


def test_stochastic_reference_is_unbiased():
    x = torch.full((32, 32), 1.03)  # between 1.0 and 1.125 (scale 2**-8 keeps the grid)
    g = torch.Generator().manual_seed(0)
    means = torch.stack([dequantize_reference(quantize_reference(x, stochastic=True, generator=g))
                         for _ in range(64)]).mean()
    assert abs(float(means) - 1.03) < 2e-3


def test_gemm_matches_dequantized_reference():
    # The interpreter's fp8 dot is exact; Hopper's fp8 MMA adds products with a shortened
    # mantissa (~1.3e-4 here, see test_gpu_gemm_matches_reference).
    tol = 1e-3 if CUDA else 1e-5
    a = _outliers(96, 160, seed=6)
    b = _outliers(80, 160, seed=7)  # (out, in) like a weight
    aq, bq = quantize(a, kernel="triton"), quantize(b, kernel="triton")
    out = gemm(aq, bq.t(), torch.float32, kernel="triton")
    ref = gemm_reference(aq, bq.t(), torch.float32)
    assert _rel(out, ref) < tol
    unpiped = gemm_triton(aq, bq.t(), torch.float32, autotune=False, pipe=False)
    assert _rel(unpiped, ref) < tol
    # transposed operand through strides (input-gradient shape): (96 x 80) @ (80 x 160)
    g = quantize(_outliers(96, 80, seed=8), kernel="triton")
    assert _rel(gemm(g, bq, torch.float32, kernel="triton"),
                gemm_reference(g, bq, torch.float32)) < tol


CFGS = [Fp8Config(block=32), Fp8Config(block=32, hadamard=True, hadamard_block=32),
        Fp8Config(block=32, stochastic_rounding=True, wgrad="fp8"),
        Fp8Config(block=128, hadamard=True, hadamard_block=64),
        Fp8Config(block=128, stochastic_rounding=True, wgrad="fp8"),
        Fp8Config(block=128, wgrad="fp8")]


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: f"b{c.block}h{int(c.hadamard)}{c.wgrad}"
                         f"{'sr' if c.stochastic_rounding else ''}")
@pytest.mark.parametrize("kernel", ["triton", "pytorch"])
def test_linear_gradients_close_to_bf16(cfg, kernel):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64, device=DEV)
    x = torch.randn(4, 32, 128, device=DEV, requires_grad=True)
    fp8 = Fp8BlockLinear.from_linear(lin, cfg, kernel=kernel)
    assert fp8.weight is lin.weight
    gy = torch.randn(4, 32, 64, device=DEV)
    y = fp8(x)
    y.backward(gy)
    dx, dw, db = x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()
    x.grad = None
    lin.zero_grad()
    y_ref = lin(x)
    y_ref.backward(gy)
    # stated tolerances: FP8 e4m3 operands (~2.6% rms each) -> ~4-5% relative on products
    assert _rel(y, y_ref) < 0.06
    assert _rel(dx, x.grad) < 0.08
    assert _rel(dw, lin.weight.grad) < (0.08 if cfg.wgrad == "fp8" else 0.03)
    assert _rel(db, lin.bias.grad) < 1e-5


@pytest.mark.parametrize("tokens", [200, 37])
def test_fp8_weight_gradient_at_any_token_count(tokens):
    """wgrad='fp8' on the 128 route at a jagged token count (not a multiple of 128): the
    weight gradient is the FP8 product of the dual quantizations' token-major copies (zero
    padding adds nothing), not a silent bf16 fallback."""
    torch.manual_seed(5)
    cfg = Fp8Config(block=128, wgrad="fp8")
    lin = torch.nn.Linear(128, 64, device=DEV)
    x = torch.randn(tokens, 128, device=DEV, requires_grad=True)
    gy = torch.randn(tokens, 64, device=DEV)
    Fp8BlockLinear.from_linear(lin, cfg, kernel="triton")(x).backward(gy)
    gt = quantize_reference(_tokens_padded_t(gy), (1, 128))
    xt = quantize_reference(_tokens_padded_t(x.detach()), (1, 128))
    expect = gemm_reference(gt, xt.t(), torch.float32)
    if CUDA:  # cuBLAS's blockwise GEMM: the same operands, its own summation order
        assert _rel(lin.weight.grad, expect) < 1e-3
    else:  # off CUDA the layer's GEMM is the reference itself
        assert torch.equal(lin.weight.grad, expect)
    assert _rel(lin.weight.grad, gy.t() @ x.detach()) < 0.08


def test_bf16_fallback_of_an_fp8_weight_gradient_is_said_once():
    """A Hadamard layer on the 128 route at a token count that is not a multiple of 128 has
    no token-major FP8 copy: its weight gradient runs in bf16, and a warning says so."""
    cfg = Fp8Config(block=128, hadamard=True, hadamard_block=64, wgrad="fp8", seed=7)
    lin = Fp8BlockLinear(128, 64, cfg=cfg, kernel="pytorch", device=DEV)
    with pytest.warns(UserWarning, match="ran in bf16"):
        lin(torch.randn(37, 128, device=DEV)).sum().backward()
    assert lin.weight.grad is not None


def test_linear_consumes_prequantized_weight():
    torch.manual_seed(1)
    cfg = Fp8Config(block=32, hadamard=True, hadamard_block=32)
    lin = Fp8BlockLinear(64, 32, cfg=cfg, kernel="pytorch")
    x = torch.randn(32, 64)
    wq = Fp8BlockWeight(quantize_weight(lin.weight, cfg, "pytorch"), lin.weight.dtype,
                        hadamard=hadamard_for(cfg, x.device))
    w_param = torch.nn.Parameter(wq)
    out = fp8_block_linear(x, w_param, lin.bias, cfg, kernel="pytorch")
    assert torch.allclose(out, lin(x))  # same bytes as quantizing inside the layer
    # generic ops fall back to the dequantized (and un-rotated) weight
    assert _rel(w_param.detach() + 0, lin.weight) < 0.04
    out.sum().backward()
    assert w_param.grad is not None and w_param.grad.shape == lin.weight.shape


def test_cpu_training_in_fp8_tracks_bf16():
    """A few optimizer steps of a small MLP regression: FP8 layers train like full precision."""
    def run(fp8: bool) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                    torch.nn.Linear(128, 1))
        if fp8:
            model[0] = Fp8BlockLinear.from_linear(model[0], Fp8Config(block=32, hadamard=True,
                                                                      hadamard_block=64))
        opt = torch.optim.Adam(model.parameters(), lr=5e-3)
        g = torch.Generator().manual_seed(1)
        w_true = torch.randn(64, 1, generator=g)
        for _ in range(20):
            x = torch.randn(32, 64, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ w_true))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return float(loss.detach())

    base, fp8 = run(False), run(True)
    assert fp8 < 0.5  # it learned (the initial loss is ~0.9)
    assert abs(fp8 - base) < 0.15 * base + 0.01


def test_fp8_layer_is_opaque_inside_a_compiled_module():
    """torch.compile fuses the glue around an FP8 layer and runs the layer itself as it is (a
    graph break, not a trace into its Triton kernels): outputs and gradients equal eager's."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    cfg = Fp8Config(block=32)
    block = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 128),
                                torch.nn.GELU(), torch.nn.Linear(128, 64))
    block[1] = Fp8BlockLinear.from_linear(block[1], cfg, kernel="pytorch")
    x = torch.randn(48, 64)

    def grads(module: torch.nn.Module) -> list[torch.Tensor]:
        block.zero_grad(set_to_none=True)
        module(x).square().sum().backward()
        return [p.grad.clone() for p in block.parameters()]

    eager_out, eager_grads = block(x), grads(block)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend="aot_eager")
    assert torch.equal(compiled(x), eager_out)
    assert all(torch.equal(a, b) for a, b in zip(grads(compiled), eager_grads, strict=True))
    # compiled around the layer, which ran as it is (a graph break), not traced into
    assert any("fp8_block_linear" in reason for reason in counters["graph_break"])


def _gpu_case(m, k, n, cfg):
    torch.manual_seed(0)
    x = _outliers(m, k, seed=11, device=DEV).to(torch.bfloat16).requires_grad_()
    lin = torch.nn.Linear(k, n, device=DEV, dtype=torch.bfloat16)
    fp8 = Fp8BlockLinear.from_linear(lin, cfg)
    gy = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
    y = fp8(x)
    y.backward(gy)
    dx, dw = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.zero_grad()
    xr = x.detach().float().requires_grad_()
    yr = xr @ lin.weight.float().t() + lin.bias.float()
    yr.backward(gy.float())
    return _rel(y, yr), _rel(dx, xr.grad), _rel(dw, gy.float().t() @ xr.detach())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("block", BLOCKS)
def test_gpu_quantize_bytes_match_reference(block):
    x = _outliers(4096, 1024, seed=9, device=DEV).to(torch.bfloat16)
    q = quantize(x, block)
    ref = quantize_reference(x, block)
    assert torch.equal(_bytes(q), _bytes(ref)) and torch.equal(q.scale, ref.scale)
    hq = hadamard_matrix(128, device=DEV)
    qh = quantize(x, block, hadamard=hq)
    rh = quantize_reference(x, block, hadamard=hq)
    assert _close_codes(qh, rh)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_hardware_rounding_equals_the_emulation():
    """The hardware e4m3 conversion (round to nearest even) gives the reference's bytes, ties,
    subnormals and zero included: values that round to zero, negative ones too, give +0."""
    from gem_kernels.fp8.quantize import hardware_cast, quantize_triton

    x = _outliers(1024, 512, seed=12, device=DEV)
    x[:64, :64] = -1e-6 * torch.rand(64, 64, device=DEV)  # a block whose small values -> 0
    x[64:96, :32] = 1.0
    x[64:96, 0] = 448.0
    x[64:96, 1:32] = torch.arange(1, 32, device=DEV) * 2.0**-10 - 2.0**-9  # ties and subnormals
    x[100, :] = -0.0
    x = x.to(torch.bfloat16)
    assert hardware_cast(x) and not hardware_cast(x, False)
    for block in ((32, 32), (1, 128)):
        ref = _bytes(quantize_reference(x, block))
        for hw in (True, False):
            q = quantize_triton(x, block, hadamard=None, stochastic=False, seed=0, hw_cast=hw)
            assert torch.equal(_bytes(q), ref), (block, hw)
    for hw in (True, False):
        q, qt = quantize_dual(x, hw_cast=hw)
        assert torch.equal(_bytes(q), _bytes(quantize_reference(x, (1, 128))))
        assert torch.equal(_bytes(qt), _bytes(quantize_reference(_tokens_padded_t(x),
                                                                   (1, 128))))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_gemm_matches_reference():
    a = quantize(_outliers(2048, 1024, seed=1, device=DEV).to(torch.bfloat16))
    w = quantize(_outliers(768, 1024, seed=2, device=DEV).to(torch.bfloat16))
    # Hopper's fp8 MMA adds its products with a shortened mantissa (measured 1.7e-4 here);
    # partial sums are promoted to fp32 every 32 of K, so the error does not grow with K.
    assert _rel(gemm(a, w.t(), torch.float32), gemm_reference(a, w.t(), torch.float32)) < 1e-3
    g = quantize(_outliers(2048, 768, seed=3, device=DEV).to(torch.bfloat16))
    wk = w.k_major()
    assert _rel(gemm(g, wk, torch.float32), gemm_reference(g, w, torch.float32)) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: f"b{c.block}h{int(c.hadamard)}{c.wgrad}"
                         f"{'sr' if c.stochastic_rounding else ''}")
def test_gpu_linear_close_to_fp32(cfg):
    ey, edx, edw = _gpu_case(4096, 1024, 512, cfg)
    assert ey < 0.06 and edx < 0.08 and edw < (0.08 if cfg.wgrad == "fp8" else 0.02)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1003, 4090, 17])
def test_gpu_linear_any_token_count(m):
    """A jagged batch's token count is arbitrary; cuBLAS's blockwise GEMM wants its rows
    aligned: the 128 route pads the operand's storage (no copy) and trims the output."""
    for cfg in (Fp8Config(block=128), Fp8Config(block=128, wgrad="fp8"), Fp8Config(block=32)):
        ey, edx, edw = _gpu_case(m, 512, 256, cfg)
        assert ey < 0.06 and edx < 0.08 and edw < (0.08 if cfg.wgrad == "fp8" else 0.02), cfg
    x = _outliers(m, 256, seed=4, device=DEV).to(torch.bfloat16)
    q = quantize(x, (1, 128), scale_col_major=True)
    ref = quantize_reference(x, (1, 128))
    assert q.data.shape == (m, 256) and torch.equal(_bytes(q), _bytes(ref))
    assert torch.equal(q.scale, ref.scale) and q.scale.stride(0) == 1


@pytest.mark.parametrize("block", [(32, 32), (1, 128)])
@pytest.mark.parametrize("had", [0, 64])
def test_rmsnorm_quantize_fused_matches_reference(block, had):
    x = _outliers(70, 256, seed=12)
    w = torch.rand(256, device=DEV) + 0.5
    q = hadamard_matrix(had, device=DEV) if had else None
    got, rstd = rmsnorm_quantize(x, w, 1e-6, block, hadamard=q, kernel="triton")
    ref, rstd_ref = rmsnorm_quantize(x, w, 1e-6, block, hadamard=q, kernel="pytorch")
    assert torch.allclose(rstd, rstd_ref, rtol=1e-6)
    assert _close_codes(got, ref)
    normed = torch.nn.functional.rms_norm(x, (256,), w, 1e-6)
    expect = apply_hadamard(normed, q) if q is not None else normed
    assert _rel(dequantize_reference(got), expect) < 0.03


@pytest.mark.parametrize("cfg", [Fp8Config(block=32, wgrad="fp8"),
                                 Fp8Config(block=128, hadamard=True, hadamard_block=64)],
                         ids=["b32w8", "b128had"])
@pytest.mark.parametrize("kernel", ["triton", "pytorch"])
def test_rmsnorm_linear_gradients_close_to_full_precision(cfg, kernel):
    torch.manual_seed(3)
    norm = torch.nn.RMSNorm(128, eps=1e-6, device=DEV)
    lin = torch.nn.Linear(128, 64, device=DEV)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    fused = Fp8RMSNormLinear.from_modules(norm, lin, cfg, kernel=kernel)
    x = (torch.randn(2, 32, 128, device=DEV) * 3).requires_grad_()
    gy = torch.randn(2, 32, 64, device=DEV)
    fused(x).backward(gy)
    got = [x.grad.clone(), norm.weight.grad.clone(), lin.weight.grad.clone(),
           lin.bias.grad.clone()]
    x.grad = None
    for p in (norm.weight, lin.weight, lin.bias):
        p.grad = None
    y_ref = lin(norm(x))
    y_ref.backward(gy)
    want = [x.grad, norm.weight.grad, lin.weight.grad, lin.bias.grad]
    assert _rel(fused(x), y_ref) < 0.06
    tols = (0.08, 0.08, 0.08, 1e-5)
    for name, g, r, tol in zip(("dx", "dnorm", "dw", "db"), got, want, tols, strict=True):
        assert _rel(g, r) < tol, name


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("block", [32, 128])
def test_gpu_rmsnorm_linear_close_to_fp32(block):
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(1024, eps=1e-6, device=DEV)
    lin = torch.nn.Linear(1024, 512, device=DEV)
    fused = Fp8RMSNormLinear.from_modules(norm, lin, Fp8Config(block=block))
    x = _outliers(4096, 1024, seed=13, device=DEV).to(torch.bfloat16)
    y = fused(x)
    ref = lin(norm(x.float()))
    assert y.dtype == torch.bfloat16 and _rel(y, ref) < 0.06


def test_autotuning_is_not_keyed_on_the_exact_token_count():
    """A jagged batch has a new token count every step: an autotuner keyed on it would time
    every configuration again at every step (this once made an FP8 training step ~40x slower
    than bf16). Row counts enter the keys only as power-of-two buckets."""
    import importlib

    gemm_mod = importlib.import_module("gem_kernels.fp8.gemm")
    quant_mod = importlib.import_module("gem_kernels.fp8.quantize")

    keys = {"gemm": gemm_mod._gemm_autotuned.keys, "quantize": quant_mod._quantize_autotuned.keys,
            "quantize_dual": quant_mod._quantize_dual_autotuned.keys}
    assert "M_BUCKET" in keys["gemm"] and "M" not in keys["gemm"]
    assert "R_BUCKET" in keys["quantize"] and "R" not in keys["quantize"]
    assert "R" not in keys["quantize_dual"]


def test_blockwise_gemm_operands_are_quantized_row_padded():
    """Activations bound for cuBLAS's blockwise GEMM, from the plain quantizer and from the
    fused RMSNorm, land in storage padded to 16 rows: the GEMM reads them in place. The
    kernels write the padding themselves, as quantized zero rows (no fill kernels run)."""
    from gem_kernels.fp8.linear import _rows_aligned

    x = _outliers(70, 256, seed=13)
    w = torch.rand(256, device=DEV) + 0.5
    zero_scale = quantize_reference(torch.zeros(1, 128), (1, 128)).scale.item()
    for q in (quantize(x, (1, 128), scale_col_major=True, kernel="triton"),
              rmsnorm_quantize(x, w, block=(1, 128), scale_col_major=True, kernel="triton")[0]):
        # the storage starts as garbage: the pad must come from the kernel, not the allocator
        data, scale = _rows_aligned(q)
        assert data.shape == (80, 256) and scale.shape == (80, 2) and scale.stride() == (1, 80)
        assert data.data_ptr() == q.data.data_ptr() and scale.data_ptr() == q.scale.data_ptr()
        assert not data[70:].view(torch.uint8).any() and (scale[70:] == zero_scale).all()
    compact = BlockFp8(q.data.contiguous(), q.scale.contiguous(), (1, 128))  # copied instead
    data, scale = _rows_aligned(compact)
    assert data.data_ptr() != compact.data.data_ptr()
    assert torch.equal(data[:70].view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(scale[:70], q.scale)
    assert not data[70:].view(torch.uint8).any() and (scale[70:] == 1).all()


@pytest.mark.parametrize("block", [32, 128])
def test_weight_operand_pair_is_one_quantization_in_both_layouts(block):
    """The weight's forward operand and its K-major copy for the input gradient come from one
    quantizer pass: the same bytes and scales as quantizing once (the copy's bytes stored
    transposed), the 128x128 scales already in cuBLAS's layout (leading dimension a multiple
    of 4, zero padding), so no per-call copies remain."""
    from gem_kernels.fp8.linear import _weight_scales
    from gem_kernels.fp8.quantize import quantize_operand_pair

    w = _outliers(2 * block + 16, 3 * block, seed=21)  # 2.1 x 3 blocks: ragged last row block
    ref = quantize(w, (block, block), kernel="triton")
    wq, wk = quantize_operand_pair(w, (block, block), kernel="triton",
                                   scale_align=4 if block == 128 else 1)
    for op in (wq, wk):
        assert torch.equal(op.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(op.scale, ref.scale)
    assert wk.data.t().is_contiguous() and wq.data.is_contiguous()
    if block == 128:
        for sc in (wq.scale.t(), wk.scale):  # as the forward and input-gradient GEMMs read them
            laid = _weight_scales(sc)
            assert laid.shape == (4, sc.shape[1]) and laid.stride() == (1, 4)
            assert laid.data_ptr() == sc.data_ptr()  # in place, not copied
            assert torch.equal(laid[: sc.shape[0]], sc) and not laid[sc.shape[0]:].any()


def test_bias_is_added_in_the_gemm_before_rounding():
    """The bias enters the FP8 GEMM's fp32 accumulator (one rounding to the output dtype, as
    an addmm epilogue), for both blocks; the reference adds it before its rounding too."""
    torch.manual_seed(5)
    x, w = torch.randn(48, 256, device=DEV), torch.randn(64, 256, device=DEV)
    bias = torch.randn(64, device=DEV) * 10
    for block, act in ((32, (32, 32)), (128, (1, 128))):
        xq = quantize(x, act, kernel="triton")
        wq = quantize(w, (block, block), kernel="triton")
        want = (gemm_reference(xq, wq.t(), torch.float32) + bias).to(torch.bfloat16)
        got = fp8_matmul(xq, wq.t(), torch.bfloat16, resolve_kernel("triton", x), bias=bias)
        assert torch.equal(gemm_reference(xq, wq.t(), torch.bfloat16, bias=bias), want)
        assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7


@pytest.mark.parametrize("fused_norm", [False, True])
def test_under_autocast_the_layer_works_in_autocast_dtype(fused_norm):
    """Inside autocast an FP8 layer behaves as nn.Linear does there: an fp32 activation (a
    norm's output) gives an output in autocast's dtype, and the weight gradient's GEMM runs on
    bf16 operands (with the activation kept fp32, it ran as an fp32 GEMM on CUDA cores and
    everything downstream ran in fp32)."""
    torch.manual_seed(3)
    cfg = Fp8Config(block=128)
    lin = Fp8BlockLinear(128, 256, cfg=cfg, kernel="pytorch").to(DEV)
    norm = torch.nn.RMSNorm(128).to(DEV)
    layer = Fp8RMSNormLinear.from_modules(norm, lin, cfg, kernel="pytorch") if fused_norm else lin
    x = torch.randn(64, 128, device=DEV, requires_grad=True)
    saved: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autocast(DEV, dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
        expected = torch.nn.functional.linear(norm(x) if fused_norm else x, lin.weight, lin.bias)
    assert y.dtype == expected.dtype == torch.bfloat16
    if not fused_norm:  # the fused layer keeps x itself (fp32) for the norm's backward
        assert (torch.float32, tuple(x.shape)) not in saved
    assert _rel(y, expected) < 0.08

    class WeightGradGemms(TorchDispatchMode):
        """Operand dtypes of every matmul that produces a weight-shaped result."""

        def __init__(self) -> None:
            super().__init__()
            self.dtypes: list[tuple[torch.dtype, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default) \
                    and tuple(out.shape) == tuple(lin.weight.shape):
                self.dtypes.append(tuple(a.dtype for a in args[:2]))
            return out

    with WeightGradGemms() as gemms:
        y.float().sum().backward()
    assert gemms.dtypes == [(torch.bfloat16, torch.bfloat16)]  # the bf16 weight gradient
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert torch.isfinite(lin.weight.grad).all()


def test_scaled_mm_bias_falls_back_where_refused():
    """cuBLAS's blockwise GEMM takes the bias in its epilogue for a bf16 output; torch 2.11
    refuses one for an fp32 output (ValueError, seen on the H200), and then the bias is added
    after the GEMM instead. CPU stand-in for scaled_mm with that rule (no cuBLAS here)."""
    from gem_kernels.fp8.linear import _BIAS_IN_GEMM, _with_bias

    calls = []

    def scaled_mm(a, b, sa, ra, sb, rb, bias=None, output_dtype=None):
        calls.append(bias is not None)
        if bias is not None and output_dtype == torch.float32:
            raise ValueError("Bias is not supported when out_dtype is set to Float32")
        y = (a @ b).to(output_dtype)
        return y if bias is None else y + bias

    a, b, bias = torch.randn(8, 4), torch.randn(4, 6), torch.randn(6)
    _BIAS_IN_GEMM.clear()
    for dtype in (torch.bfloat16, torch.float32):
        y = _with_bias(scaled_mm, bias, a, b, None, "r", None, "r", dtype)
        torch.testing.assert_close(y, (a @ b).to(dtype) + bias.to(dtype))
    assert calls == [True, False]  # fp32: never offered the bias, so nothing was refused
    _BIAS_IN_GEMM.clear()
