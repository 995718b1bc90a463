"""Element-wise activations of GDPA (no softmax): exact PyTorch forms and the GELU-tanh
polynomial the Triton kernels use instead of the special-function ``tanh``.

GELU-tanh is ``x * s(x)`` with ``s(x) = 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``.
``s(x) - 0.5`` is odd, so the kernels evaluate ``s(x) = 0.5 + x * P(x^2)`` on ``|x| <= R``
(``P`` a least-squares fit, Horner on ordinary FMA units) and the exact asymptotes outside
(``s = 1`` for ``x > R``, ``s = 0`` for ``x < -R``). The fit and its error bound are fixed
below and checked by the tests.
"""

from __future__ import annotations

import math

import torch

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "identity")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

# --- GELU-tanh polynomial ---------------------------------------------------------------
# Filled in by the fit below (see ``fit_gelu_tanh_poly``); coefficients of P in powers of
# x^2, lowest first.
GELU_POLY_R = 3.5
GELU_POLY_COEFFS: tuple[float, ...] = ()
# Largest |x| over which |gelu_poly(x) - gelu_tanh(x)| stays below bf16 resolution, i.e.
# below half a bf16 ulp of max(|gelu_tanh(x)|, 2^-4).
GELU_POLY_VALID_RANGE = 0.0


def gelu_tanh_exact(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def apply_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The exact activation (reference semantics)."""
    if activation == "silu":
        return torch.nn.functional.silu(x)
    if activation == "gelu":
        return torch.nn.functional.gelu(x)
    if activation == "gelu_tanh":
        return gelu_tanh_exact(x)
    if activation == "identity":
        return x
    raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
