"""Public GDPA op: Triton kernels on CUDA, PyTorch reference elsewhere."""

from __future__ import annotations

import math

import torch

from gem_kernels.dispatch import Kernel, resolve_kernel
from gem_kernels.gdpa.reference import check_inputs, gdpa_reference

_NORM_CODE = {"none": 0, "kv_len": 1, "max_len": 2}


def triton_supported(q: torch.Tensor) -> bool:
    """The kernels take fp16/bf16/fp32 and a power-of-two head_dim in [16, 256]."""
    d = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and 16 <= d <= 256 and d & (d - 1) == 0)


def gdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
         kv_offsets: torch.Tensor, max_q: int, max_kv: int, *, activation: str = "silu",
         scale: float | None = None, norm: str = "none",
         kernel: Kernel | str | None = None) -> torch.Tensor:
    """Generalized dot-product attention on jagged Q and jagged KV, no softmax.

    out_i = sum over the KV rows j of i's sample of act(scale * q_i . k_j) * v_j, optionally
    divided by the sample's KV length (norm="kv_len"; 0 rows -> 0) or by max_kv
    (norm="max_len"). q: (total_q, H, d); k, v: (total_kv, H, d); q_offsets, kv_offsets:
    int64 (B+1,); max_q / max_kv >= the longest Q / KV sample. activation: "silu", "gelu",
    "gelu_tanh" or "identity" (the Triton path evaluates gelu_tanh by a polynomial, see
    activations.py). scale defaults to 1/sqrt(d). kernel: None/'auto' (Triton on CUDA,
    reference elsewhere), 'triton' or 'pytorch'. Returns (total_q, H, d) in q's dtype.
    """
    check_inputs(q, k, v, q_offsets, kv_offsets, activation, norm)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    which = resolve_kernel(kernel, q, k, v)
    if which is Kernel.TRITON and not triton_supported(q):
        if kernel is not None and Kernel(kernel) is Kernel.TRITON:
            raise RuntimeError(f"the Triton GDPA kernels do not support dtype {q.dtype} / "
                               f"head_dim {q.shape[-1]}")
        which = Kernel.PYTORCH
    if which is Kernel.PYTORCH:
        return gdpa_reference(q, k, v, q_offsets, kv_offsets, max_q, max_kv,
                              activation=activation, scale=scale, norm=norm)
    from gem_kernels.gdpa.autograd import GDPAFunction

    return GDPAFunction.apply(q, k, v, q_offsets, kv_offsets, int(max_q), int(max_kv),
                              activation, float(scale), _NORM_CODE[norm])
