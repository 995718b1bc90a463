"""The kernel-choice rule and the deterministic backward (gem_kernels.dispatch).

Under the CPU interpreter (small shapes, fp16/fp32: its bf16 dot is wrong): the switch's
precedence, the error a caller gets when Triton cannot take its inputs, and, per op, a
deterministic backward that matches the reference and the fast backward and is bitwise
identical across calls. GPU tests (marked): bitwise repeatability over several backwards at
realistic jagged shapes for every op with a backward.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from gem_kernels import (  # noqa: E402
    Kernel,
    deterministic_backward,
    resolve_kernel,
    set_deterministic_backward,
)
from gem_kernels.block_attention import (  # noqa: E402
    RopeConfig,
    block_attention,
    block_attention_reference,
)
from gem_kernels.dispatch import interpreting  # noqa: E402
from gem_kernels.gdpa import gdpa, gdpa_reference  # noqa: E402
from gem_kernels.gdpa.op import BackwardMode, GDPAFunction, backward_mode  # noqa: E402
from gem_kernels.jagged_attention import (  # noqa: E402
    jagged_attention,
    jagged_attention_reference,
)
from gem_kernels.testing import offsets_from_lengths  # noqa: E402

interpreter = pytest.mark.skipif(not interpreting(),
                                 reason="CPU Triton interpreter tests (CUDA present)")


@pytest.fixture
def switch_state():
    """Leaves the process-wide switch and torch's deterministic flag as it found them."""
    torch_flag = torch.are_deterministic_algorithms_enabled()
    torch_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    set_deterministic_backward(None)
    torch.use_deterministic_algorithms(torch_flag, warn_only=torch_warn)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _randn(rows: int, heads: int, dim: int, dtype: torch.dtype, g: torch.Generator,
           device: str = "cpu") -> torch.Tensor:
    return torch.randn(rows, heads, dim, generator=g).to(device, dtype)


def _grads(op, tensors, do):  # noqa: ANN001, ANN202
    """(out, dq, dk, dv) of op on fresh leaves."""
    leaves = [t.detach().requires_grad_(True) for t in tensors]
    out = op(*leaves)
    return (out, *torch.autograd.grad(out, leaves, do))


# --- the switch and the kernel-choice rule --------------------------------------------------

def test_switch_follows_torch_unless_set_and_an_op_argument_wins(switch_state) -> None:
    set_deterministic_backward(None)
    torch.use_deterministic_algorithms(False)
    assert deterministic_backward() is False
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert deterministic_backward() is True
    assert deterministic_backward(False) is False  # the op's own argument wins
    set_deterministic_backward(False)
    assert deterministic_backward() is False  # the process switch wins over torch's flag
    torch.use_deterministic_algorithms(False)
    set_deterministic_backward(True)
    assert deterministic_backward() is True
    assert deterministic_backward(False) is False
    with pytest.raises(TypeError, match="True, False or None"):
        set_deterministic_backward("yes")  # type: ignore[arg-type]


def test_one_rule_for_the_kernel_choice() -> None:
    x = torch.zeros(2, 2)
    assert resolve_kernel(None, x) is Kernel.PYTORCH  # auto off CUDA
    assert resolve_kernel("pytorch", x, unsupported="takes nothing") is Kernel.PYTORCH
    with pytest.raises(ValueError, match="kernel='cuda' is not one of"):
        resolve_kernel("cuda", x, op="gdpa")
    if interpreting():
        assert resolve_kernel("triton", x) is Kernel.TRITON
        with pytest.raises(RuntimeError, match="myop: .*takes head_dim 64.*kernel='pytorch'"):
            resolve_kernel("triton", x, unsupported="takes head_dim 64, not 12", op="myop")


def test_ops_name_what_their_triton_kernel_cannot_take() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (_randn(5, 1, 12, torch.float32, g) for _ in range(3))
    off = offsets_from_lengths([5])
    with pytest.raises(RuntimeError, match="gdpa: .*power-of-two head_dim in \\[16, 256\\], "
                                           "not 12"):
        gdpa(q, k, v, off, off, 5, 5, kernel="triton")
    assert torch.equal(gdpa(q, k, v, off, off, 5, 5),  # auto: the reference
                       gdpa_reference(q, k, v, off, off, 5, 5, scale=12 ** -0.5))
    q, k, v = (_randn(5, 1, 64, torch.float32, g) for _ in range(3))
    with pytest.raises(RuntimeError, match="jagged_attention: .*fp16/bf16 inputs, not "
                                           "torch.float32"):
        jagged_attention(q, k, v, off, 5, kernel="triton")
    with pytest.raises(RuntimeError, match="block_attention: .*fp16/bf16 inputs"):
        block_attention(q, k, v, off, kernel="triton")


# --- GDPA ------------------------------------------------------------------------------------

def test_gdpa_deterministic_plans_have_no_atomics() -> None:
    for max_q, max_kv in ((2048, 16), (8, 2048), (2048, 2048)):
        for dtype in (torch.bfloat16, torch.float32):
            assert backward_mode(max_q, max_kv, dtype, deterministic=True).deterministic
    assert not backward_mode(2048, 2048, torch.bfloat16).deterministic  # fast: atomics
    assert not backward_mode(8, 2048).deterministic
    # short Q, fast request, a batch whose (sample, head) items balance: atomic-free anyway
    assert backward_mode(8, 2048, batch=1024, heads=4, total_kv=1024 * 400,
                         sms=132).deterministic
    assert backward_mode(2048, 16) is BackwardMode.SHORT_KV  # atomic-free anyway
    assert {m for m in BackwardMode if m.deterministic} == {
        BackwardMode.SHORT_KV, BackwardMode.SHORT_Q_STREAM, BackwardMode.TWO_KERNEL}


@interpreter
def test_gdpa_refuses_an_atomic_plan_when_deterministic() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (_randn(70, 1, 16, torch.float32, g).requires_grad_() for _ in range(3))
    off = offsets_from_lengths([70])
    with pytest.raises(ValueError, match="'one_pass' .* not deterministic"):
        GDPAFunction.apply(q, k, v, off, off, 70, 70, "silu", 0.25, 0, None, None, None,
                           "one_pass", True)
    with pytest.raises(ValueError, match="unknown GDPA backward mode 'fastest'"):
        GDPAFunction.apply(q, k, v, off, off, 70, 70, "silu", 0.25, 0, None, None, None,
                           "fastest")


GDPA_SHAPES = {  # name: (Q lengths, KV lengths); self and pooled* have KV > 64 rows
    "self": ([70, 5, 0, 33], [70, 5, 0, 33]),
    "pooled": ([3, 8, 1, 0, 2], [100, 70, 0, 5, 66]),  # balanced: fast plan atomic-free too
    "pooled_few": ([3], [100]),  # one sample's items: the fast plan sums dQ by atomics
    "cross": ([70, 5, 33, 2], [16, 9, 0, 16]),
}


@interpreter
@pytest.mark.parametrize("shape", list(GDPA_SHAPES))
def test_gdpa_deterministic_backward_matches_reference_and_fast_and_repeats(shape) -> None:
    ql, kl = GDPA_SHAPES[shape]
    g = torch.Generator().manual_seed(len(shape))
    dtype, heads, dim = torch.float16, 2, 32
    q, do = _randn(sum(ql), heads, dim, dtype, g), _randn(sum(ql), heads, dim, dtype, g)
    k, v = _randn(sum(kl), heads, dim, dtype, g), _randn(sum(kl), heads, dim, dtype, g)
    qo, ko = offsets_from_lengths(ql), offsets_from_lengths(kl)

    def op(det):  # noqa: ANN001, ANN202
        return lambda q, k, v: gdpa(q, k, v, qo, ko, max(ql), max(kl), activation="gelu_tanh",
                                    kernel="triton", deterministic=det)

    fast = _grads(op(False), (q, k, v), do)
    det = _grads(op(True), (q, k, v), do)
    again = _grads(op(True), (q, k, v), do)
    ref = _grads(lambda q, k, v: gdpa_reference(q, k, v, qo, ko, max(ql), max(kl),
                                                activation="gelu_tanh"),
                 [t.float() for t in (q, k, v)], do.float())
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    assert op(True)(*leaves).grad_fn.mode.deterministic
    fast_mode = op(False)(*leaves).grad_fn.mode
    assert fast_mode is {"self": BackwardMode.ONE_PASS, "pooled": BackwardMode.SHORT_Q_STREAM,
                         "pooled_few": BackwardMode.SHORT_Q,
                         "cross": BackwardMode.SHORT_KV}[shape]
    for a, b in zip(det, again, strict=True):
        assert torch.equal(a, b)
    for name, d, f, r in zip(["out", "dq", "dk", "dv"], det, fast, ref, strict=True):
        assert _rel(d, r) < 5e-3, (name, _rel(d, r))
        assert _rel(d, f) < 5e-3, (name, _rel(d, f))


@interpreter
def test_gdpa_follows_the_process_switch_and_torch(switch_state) -> None:
    ql = [70, 9]
    g = torch.Generator().manual_seed(3)
    q, k, v = (_randn(sum(ql), 1, 16, torch.float16, g).requires_grad_() for _ in range(3))
    off = offsets_from_lengths(ql)

    def mode() -> BackwardMode:
        return gdpa(q, k, v, off, off, 70, 70, kernel="triton").grad_fn.mode

    set_deterministic_backward(None)
    torch.use_deterministic_algorithms(False)
    assert mode() is BackwardMode.ONE_PASS
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert mode() is BackwardMode.TWO_KERNEL
    torch.use_deterministic_algorithms(False)
    set_deterministic_backward(True)
    assert mode() is BackwardMode.TWO_KERNEL


# --- jagged and block attention: atomic-free backwards, so deterministic either way --------

@interpreter
def test_jagged_attention_deterministic_backward_matches_reference_and_repeats() -> None:
    lengths = [40, 3, 0, 17]
    g = torch.Generator().manual_seed(4)
    q, k, v, do = (_randn(sum(lengths), 2, 32, torch.float16, g) for _ in range(4))
    off = offsets_from_lengths(lengths)

    def op(q, k, v):  # noqa: ANN001, ANN202
        return jagged_attention(q, k, v, off, 40, causal=True, kernel="triton",
                                deterministic=True)

    a, b = _grads(op, (q, k, v), do), _grads(op, (q, k, v), do)
    ref = _grads(lambda q, k, v: jagged_attention_reference(q, k, v, off, 40, causal=True),
                 [t.float() for t in (q, k, v)], do.float())
    for x, y, r in zip(a, b, ref, strict=True):
        assert torch.equal(x, y)
        assert _rel(x, r) < 5e-3


@interpreter
def test_block_attention_deterministic_backward_matches_reference_and_repeats() -> None:
    lengths = [70, 5, 0, 64]
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (_randn(sum(lengths), 2, 64, torch.float16, g) for _ in range(4))
    off = offsets_from_lengths(lengths)

    def op(q, k, v):  # noqa: ANN001, ANN202
        return block_attention(q, k, v, off, rope=RopeConfig(), kernel="triton",
                               deterministic=True)

    a, b = _grads(op, (q, k, v), do), _grads(op, (q, k, v), do)
    ref = _grads(lambda q, k, v: block_attention_reference(q, k, v, off, rope=RopeConfig()),
                 [t.float() for t in (q, k, v)], do.float())
    for x, y, r in zip(a, b, ref, strict=True):
        assert torch.equal(x, y)
        assert _rel(x, r) < 5e-3


# --- GPU: bitwise repeatability at realistic shapes ------------------------------------------

@functools.cache
def _gpu_cases() -> dict:
    from gem_bench.kernels.deterministic import cases

    return cases(batch=64, heads=4, dim=128)


GPU_CASES = ["gdpa_self", "gdpa_cross", "gdpa_pooled", "jfa_causal", "jfa_sliding",
             "block64_rope"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", GPU_CASES)
def test_gpu_deterministic_backward_is_bitwise_repeatable(name: str) -> None:
    """Five deterministic backwards of one output are bitwise identical, on bf16 inputs with
    log-normal (GDPA) or power-law (jagged, block) lengths up to 2048, and stay within bf16
    rounding of the fast backward."""
    op, (q, k, v, do) = _gpu_cases()[name]
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = op(*leaves, True)
    if name.startswith("gdpa"):
        assert out.grad_fn.mode.deterministic
    first = torch.autograd.grad(out, leaves, do, retain_graph=True)
    for _ in range(4):
        again = torch.autograd.grad(out, leaves, do, retain_graph=True)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)
    fast = torch.autograd.grad(op(*leaves, False), leaves, do)
    for a, b in zip(first, fast, strict=True):
        assert torch.isfinite(a).all()
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))
    # a fresh forward and backward gives the same gradients too
    fresh = torch.autograd.grad(op(*leaves, True), leaves, do)
    for a, b in zip(first, fresh, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block,stochastic", [(32, False), (128, False), (128, True)])
def test_gpu_fp8_linear_backward_is_bitwise_repeatable(block: int, stochastic: bool) -> None:
    """The FP8 linear layer's backward (quantizers and GEMMs, no atomics) gives bitwise-equal
    input, weight and bias gradients over three fresh forward+backward passes at a jagged
    token count; with stochastic rounding once torch's generator is reseeded."""
    from gem_kernels.fp8 import Fp8BlockLinear, Fp8Config

    torch.manual_seed(0)
    lin = Fp8BlockLinear(1024, 2048, cfg=Fp8Config(block=block, stochastic_rounding=stochastic),
                         device="cuda", dtype=torch.bfloat16)
    x = torch.randn(12_345, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(12_345, 2048, device="cuda", dtype=torch.bfloat16)

    def grads() -> tuple[torch.Tensor, ...]:
        torch.manual_seed(1)
        xl = x.detach().requires_grad_(True)
        lin.zero_grad(set_to_none=True)
        lin(xl).backward(dy)
        return xl.grad, lin.weight.grad, lin.bias.grad

    first = grads()
    for _ in range(2):
        for a, b in zip(first, grads(), strict=True):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b)
