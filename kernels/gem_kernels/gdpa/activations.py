"""Element-wise activations of GDPA (no softmax): exact PyTorch forms and the GELU-tanh
polynomial the Triton kernels use instead of the special-function ``tanh``.

GELU-tanh is ``x * s(x)`` with ``s(x) = 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``.
``s(x) - 0.5`` is odd, so the kernels evaluate ``s(x) = 0.5 + x * P(x^2)`` on ``|x| <= R``
(``P`` a least-squares fit, Horner on ordinary FMA units) on ``x`` clamped to ``[-R, R]``, so
``x > R`` keeps ``s(R)`` (1 within 2e-5, far inside the error bound relative to ``x``) and only
``x < -R`` needs a select (``s = 0``): one compare and one select per element instead of four
operations for both tails. The fit and its error bound are fixed below and checked by the
tests.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "identity")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

# --- GELU-tanh polynomial ---------------------------------------------------------------
# P: least-squares fit of (s(x) - 0.5) / x on Chebyshev nodes of [0, R], in powers of x^2,
# lowest first (degree 16 in x; 8 FMAs by Horner). Beyond x > R the clamped value s(R) =
# 1 - 5.6e-6 stands in for 1; below x < -R, s = 0.
GELU_POLY_R = 4.0
GELU_POLY_COEFFS: tuple[float, ...] = (
    0.39894118554, -0.066799666098, 0.010165806145, -0.0012219571409, 0.00011368564781,
    -7.7733934599e-06, 3.594455799e-07, -9.8607252589e-09, 1.1979256476e-10,
)
# Error bound, checked in fp32 by the tests on a dense grid: for |x| <= GELU_POLY_VALID_RANGE,
#   |gelu_poly(x) - gelu_tanh(x)| <= 2^-9 * max(|gelu_tanh(x)|, 2^-4),
# i.e. below half a bf16 ulp of the exact value (values under 2^-4 in magnitude are held to
# the absolute error 2^-13). Worst case 0.58 of that bound, at x = -4 where the polynomial
# hands over to the asymptote. With QK-norm, |scale * q.k| <= sqrt(d) (11.3 for d = 128), so
# the range covers every score the model can produce; beyond it the tails stay within the
# same bound because gelu_tanh(x) -> x (x > 0, relative error 5.6e-6 from s(R)) and -> 0
# (x < 0) faster than the bound.
GELU_POLY_VALID_RANGE = 12.0


def gelu_tanh_poly(x: torch.Tensor) -> torch.Tensor:
    """The polynomial form the Triton kernels evaluate (same operation order, fp32)."""
    xf = x.float()
    xc = xf.clamp(-GELU_POLY_R, GELU_POLY_R)
    x2 = xc * xc
    p = torch.full_like(xf, GELU_POLY_COEFFS[-1])
    for c in GELU_POLY_COEFFS[-2::-1]:
        p = p * x2 + c
    s = torch.where(xf < -GELU_POLY_R, 0.0, 0.5 + xc * p)
    return (xf * s).to(x.dtype)


def gelu_tanh_exact(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def apply_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The exact activation (reference semantics)."""
    if activation == "silu":
        return torch.nn.functional.silu(x)
    if activation == "gelu":
        return torch.nn.functional.gelu(x)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if activation == "identity":
        return x
    raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")


# --- Triton device functions -------------------------------------------------------------
# Activation codes shared with the kernels.
ACT_CODE = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "identity": 3}

_R = tl.constexpr(GELU_POLY_R)
_C0 = tl.constexpr(GELU_POLY_COEFFS[0])
_C1 = tl.constexpr(GELU_POLY_COEFFS[1])
_C2 = tl.constexpr(GELU_POLY_COEFFS[2])
_C3 = tl.constexpr(GELU_POLY_COEFFS[3])
_C4 = tl.constexpr(GELU_POLY_COEFFS[4])
_C5 = tl.constexpr(GELU_POLY_COEFFS[5])
_C6 = tl.constexpr(GELU_POLY_COEFFS[6])
_C7 = tl.constexpr(GELU_POLY_COEFFS[7])
_C8 = tl.constexpr(GELU_POLY_COEFFS[8])


@triton.jit
def _gelu_poly_p(x2):
    p = _C8 * x2 + _C7
    p = p * x2 + _C6
    p = p * x2 + _C5
    p = p * x2 + _C4
    p = p * x2 + _C3
    p = p * x2 + _C2
    p = p * x2 + _C1
    p = p * x2 + _C0
    return p


@triton.jit
def _gelu_poly_dp(x2):
    """dP/d(x^2)."""
    d = (8.0 * _C8) * x2 + 7.0 * _C7
    d = d * x2 + 6.0 * _C6
    d = d * x2 + 5.0 * _C5
    d = d * x2 + 4.0 * _C4
    d = d * x2 + 3.0 * _C3
    d = d * x2 + 2.0 * _C2
    d = d * x2 + _C1
    return d


@triton.jit
def act_fwd(x, ACT: tl.constexpr):
    """act(x) for an fp32 tile."""
    if ACT == 0:
        return x * tl.sigmoid(x)
    elif ACT == 1:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:
        xc = tl.minimum(tl.maximum(x, -_R), _R)
        s = tl.where(x < -_R, 0.0, 0.5 + xc * _gelu_poly_p(xc * xc))
        return x * s
    else:
        return x


@triton.jit
def act_fwd_and_grad(x, ACT: tl.constexpr):
    """(act(x), act'(x)) for an fp32 tile; for gelu_tanh the derivative of the polynomial."""
    if ACT == 0:
        sg = tl.sigmoid(x)
        y = x * sg
        return y, sg + y * (1.0 - sg)
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        return x * cdf, cdf + x * pdf
    elif ACT == 2:
        xc = tl.minimum(tl.maximum(x, -_R), _R)
        x2 = xc * xc
        inside = tl.abs(x) <= _R
        p = _gelu_poly_p(x2)
        s = tl.where(x < -_R, 0.0, 0.5 + xc * p)
        ds = tl.where(inside, p + 2.0 * x2 * _gelu_poly_dp(x2), 0.0)
        return x * s, s + x * ds
    else:
        return x, tl.full(x.shape, 1.0, tl.float32)
