"""Element-wise activations of GDPA (no softmax): exact PyTorch forms and the GELU-tanh
polynomial the Triton kernels use instead of the special-function ``tanh``.

GELU-tanh is ``x * s(x)`` with ``s(x) = 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``.
``s(x) - 0.5`` is odd, so the kernels evaluate ``s(x) = 0.5 + x * P(x^2)`` on ``x`` clamped to
``[-R, R]`` (``P`` of degree 7 in ``x^2``: 7 FMAs by Horner on ordinary ALUs). The fit is
constrained to ``s(R) = 1`` and ``s'(R) = 0``, so the clamp alone gives both tails (``x > R``:
``s = 1``; ``x < -R``: ``s = 0``) and the clamped derivative vanishes there: no compare, no
select, in the forward or the backward. Every instruction per score element counts: the
forward spends about as many issue slots on the activation as on the two matmuls.

The kernels also fold the attention scale into the coefficients (``P`` evaluated on the raw
dot product) and multiply the accumulator by the scale once per tile instead of every score.

The backward needs ``g(x) = d/dx [x s(x)]``. Differentiating the exact form gives
``g = s + t s (1 - s)`` with ``t = 2 sqrt(2/pi) x (1 + 3 * 0.044715 x^2)``: from the
polynomial's ``s`` that is 4 instructions per score (the polynomial's own derivative took 8)
and it is 3x closer to the exact derivative (max error 3.5e-4 vs 1.2e-3 on [-12, 12]; the
derivative of a minimax fit errs more than the fit). Past the clamp ``s`` is 1 (or ~0), so
``s (1 - s)`` vanishes and ``g`` is 1 (or ~0) as it should be.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "identity")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

# --- GELU-tanh polynomial ---------------------------------------------------------------
# P: minimax fit (linear program on a dense grid) of the weighted error below on [0, R], in
# powers of x^2, lowest first, under the constraints R P(R^2) = 1/2 and s'(R) = 0.
GELU_POLY_R = 4.0
GELU_POLY_COEFFS: tuple[float, ...] = (
    0.39904659523, -0.066505301988, 0.009801466021, -0.0010699027792, 8.2027061132e-05,
    -4.1033058629e-06, 1.1862356149e-07, -1.4904358417e-09,
)
# Error bound, checked in fp32 by the tests on a dense grid: for |x| <= GELU_POLY_VALID_RANGE,
#   |gelu_poly(x) - gelu_tanh(x)| <= 2^-9 * max(|gelu_tanh(x)|, 2^-4),
# i.e. below half a bf16 ulp of the exact value (values under 2^-4 in magnitude are held to
# the absolute error 2^-13). Worst case 0.65 of that bound in fp32. With QK-norm,
# |scale * q.k| <= sqrt(d) (11.3 for d = 128), so the range covers every score the model can
# produce. Beyond R the clamped s is 1 (x > R: relative error 5.6e-6) or, after fp32
# rounding, ~1e-6 (x < -R: absolute error ~1e-6 |x|, inside the bound up to |x| ~ 100).
GELU_POLY_VALID_RANGE = 12.0


def _poly_s(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s, xc, xc^2): s = 0.5 (1 + tanh(...)) by the polynomial on the clamped input xc, in
    the kernels' operation order (Horner in x^2)."""
    xc = xf.clamp(-GELU_POLY_R, GELU_POLY_R)
    x2 = xc * xc
    p = torch.full_like(xf, GELU_POLY_COEFFS[-1])
    for c in GELU_POLY_COEFFS[-2::-1]:
        p = p * x2 + c
    return 0.5 + xc * p, xc, x2


def gelu_tanh_poly(x: torch.Tensor) -> torch.Tensor:
    """The polynomial form the Triton kernels evaluate (same operation order, fp32)."""
    xf = x.float()
    s, _, _ = _poly_s(xf)
    return (xf * s).to(x.dtype)


_GRAD_T1 = 2.0 * _SQRT_2_OVER_PI
_GRAD_T3 = 2.0 * _SQRT_2_OVER_PI * 3.0 * 0.044715


def gelu_tanh_poly_grad(x: torch.Tensor) -> torch.Tensor:
    """d/dx gelu_tanh as the Triton backward evaluates it from the polynomial's s (fp32)."""
    s, xc, x2 = _poly_s(x.float())
    t = xc * (_GRAD_T3 * x2 + _GRAD_T1)
    return (t * (s - s * s) + s).to(x.dtype)


def gelu_tanh_exact_grad(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI \
        * (1.0 + 3.0 * 0.044715 * x * x)


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

# Folding the scale into the GELU coefficients raises scale to the 15th power: outside this
# range fp32 would lose the top coefficients, and the kernels scale the scores instead.
_FOLD_SCALE_RANGE = (1.0 / 32, 32.0)


SCALE_MODES = ("const", "runtime", "scores")


def folds_scale(act_code: int, scale: float, dtype: torch.dtype) -> bool:
    """Whether the kernels apply ``scale`` after the second matmul (gelu_tanh, identity)
    instead of to every score. Not for fp16: the unscaled act values (up to 1/scale times
    larger) would reach fp16's range sooner."""
    return (act_code in (2, 3) and dtype != torch.float16
            and _FOLD_SCALE_RANGE[0] <= scale <= _FOLD_SCALE_RANGE[1])


def scale_args(act_code: int, scale: float, dtype: torch.dtype,
               mode: str = "const") -> tuple[bool, float]:
    """(FOLD, CSCALE) kernel constants. mode 'const' folds the scale into compile-time
    coefficients (immediate operands; one compiled kernel per scale value, which a model
    fixes), 'runtime' computes them in the kernel from the scale argument, 'scores'
    multiplies every score (no folding). CSCALE = 0.0 means 'use the runtime scale'."""
    if mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}; got {mode!r}")
    fold = mode != "scores" and folds_scale(act_code, scale, dtype)
    return fold, (float(scale) if fold and mode == "const" else 0.0)


_R = tl.constexpr(GELU_POLY_R)
_C0 = tl.constexpr(GELU_POLY_COEFFS[0])
_C1 = tl.constexpr(GELU_POLY_COEFFS[1])
_C2 = tl.constexpr(GELU_POLY_COEFFS[2])
_C3 = tl.constexpr(GELU_POLY_COEFFS[3])
_C4 = tl.constexpr(GELU_POLY_COEFFS[4])
_C5 = tl.constexpr(GELU_POLY_COEFFS[5])
_C6 = tl.constexpr(GELU_POLY_COEFFS[6])
_C7 = tl.constexpr(GELU_POLY_COEFFS[7])


@triton.jit
def _gelu_coeffs(a):
    """Coefficients of P for input x = u / a (c_j a^(2j+1)): s(u) = 0.5 + x P_a(x^2)."""
    a2 = a * a
    t0 = a
    t1 = t0 * a2
    t2 = t1 * a2
    t3 = t2 * a2
    t4 = t3 * a2
    t5 = t4 * a2
    t6 = t5 * a2
    t7 = t6 * a2
    return _C0 * t0, _C1 * t1, _C2 * t2, _C3 * t3, _C4 * t4, _C5 * t5, _C6 * t6, _C7 * t7


@triton.jit
def _gelu_s(x, a):
    """(s(u), x clamped to the polynomial's range) for raw x = u / a."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _gelu_coeffs(a)
    r = _R / a
    xc = tl.minimum(tl.maximum(x, -r), r)
    x2 = xc * xc
    p = c7 * x2 + c6
    p = p * x2 + c5
    p = p * x2 + c4
    p = p * x2 + c3
    p = p * x2 + c2
    p = p * x2 + c1
    p = p * x2 + c0
    return 0.5 + xc * p, xc


_T1 = tl.constexpr(_GRAD_T1)
_T3 = tl.constexpr(_GRAD_T3)


@triton.jit
def _gelu_grad(x, s, a):
    """d/du [u s(u)] = s + t s (1 - s), t = 2 sqrt(2/pi) u (1 + 3 * 0.044715 u^2), for raw
    x = u / a (s from _gelu_s); x is the clamped x: past the clamp s (1 - s) is ~0."""
    t = x * ((_T3 * a * a * a) * (x * x) + _T1 * a)
    return t * (s - s * s) + s


@triton.jit
def out_scale(scale, FOLD: tl.constexpr):
    """What the kernels multiply act(...)-side accumulators by (see act_fwd)."""
    if FOLD:
        return scale
    else:
        return 1.0


@triton.jit
def act_fwd(x, scale, ACT: tl.constexpr, FOLD: tl.constexpr, CSCALE: tl.constexpr):
    """For an fp32 tile of raw dots x: act(scale * x) / out_scale(scale, FOLD). With FOLD
    (gelu_tanh, identity) the scale lives in the coefficients (compile-time ones from CSCALE
    unless it is 0) and the caller multiplies its accumulator by scale once; else the scores
    are scaled here."""
    if FOLD:
        if ACT == 2:
            if CSCALE != 0.0:
                s, _ = _gelu_s(x, CSCALE)
            else:
                s, _ = _gelu_s(x, scale)
            return x * s
        else:
            return x
    else:
        u = x * scale
        if ACT == 0:
            return u * tl.sigmoid(u)
        elif ACT == 1:
            return 0.5 * u * (1.0 + tl.math.erf(u * 0.7071067811865476))
        elif ACT == 2:
            s, _ = _gelu_s(u, 1.0)
            return u * s
        else:
            return u


@triton.jit
def act_fwd_and_grad(x, scale, ACT: tl.constexpr, FOLD: tl.constexpr, CSCALE: tl.constexpr):
    """(act_fwd(x, ...), act'(scale * x)) for an fp32 tile of raw dots; for gelu_tanh the
    exact form's derivative evaluated from the polynomial's s (see _gelu_grad)."""
    if FOLD:
        if ACT == 2:
            if CSCALE != 0.0:
                s, xc = _gelu_s(x, CSCALE)
                return x * s, _gelu_grad(xc, s, CSCALE)
            else:
                s, xc = _gelu_s(x, scale)
                return x * s, _gelu_grad(xc, s, scale)
        else:
            return x, tl.full(x.shape, 1.0, tl.float32)
    else:
        u = x * scale
        if ACT == 0:
            sg = tl.sigmoid(u)
            y = u * sg
            return y, sg + y * (1.0 - sg)
        elif ACT == 1:
            cdf = 0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476))
            pdf = tl.exp(-0.5 * u * u) * 0.3989422804014327
            return u * cdf, cdf + u * pdf
        elif ACT == 2:
            s, uc = _gelu_s(u, 1.0)
            return u * s, _gelu_grad(uc, s, 1.0)
        else:
            return u, tl.full(u.shape, 1.0, tl.float32)
