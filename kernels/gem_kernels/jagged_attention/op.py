"""Public jagged attention op: Triton kernels on CUDA, PyTorch reference elsewhere."""

from __future__ import annotations

import math

import torch

from gem_kernels.dispatch import Kernel, resolve_kernel
from gem_kernels.jagged_attention.reference import _check_inputs, jagged_attention_reference


def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     max_len: int, *, causal: bool = False,
                     window: tuple[int, int] | None = None, scale: float | None = None,
                     kernel: Kernel | str | None = None,
                     deterministic: bool = False) -> torch.Tensor:
    """Softmax attention within each sequence of a jagged batch, no padding.

    q, k, v: (total_tokens, heads, head_dim) bf16/fp16 (fp32 accumulate; fp32 runs on the
    reference); offsets: int64 (B+1,); max_len >= the longest sequence. ``causal`` keeps keys
    j <= i; ``window=(left, right)`` keeps i-left <= j <= i+right (both may be given). ``scale``
    defaults to 1/sqrt(head_dim). A query with no valid key outputs 0. ``kernel``: None/'auto'
    (Triton on CUDA, reference elsewhere), 'triton' or 'pytorch'. ``deterministic=True`` makes
    the backward bitwise reproducible. Returns (total_tokens, heads, head_dim) in q's dtype.
    """
    _check_inputs(q, k, v, offsets, window)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    which = resolve_kernel(kernel, q, k, v)
    if which is Kernel.PYTORCH:
        return jagged_attention_reference(q, k, v, offsets, max_len, causal=causal,
                                          window=window, scale=scale)
    from gem_kernels.jagged_attention.triton_op import triton_supported

    if not triton_supported(q):
        if kernel is not None and Kernel(kernel) is Kernel.TRITON:
            raise RuntimeError(f"the Triton jagged attention kernel does not support dtype "
                               f"{q.dtype} / head_dim {q.shape[-1]}")
        return jagged_attention_reference(q, k, v, offsets, max_len, causal=causal,
                                          window=window, scale=scale)
    from gem_kernels.jagged_attention.triton_op import jagged_attention_triton

    return jagged_attention_triton(q, k, v, offsets, max_len, causal=causal, window=window,
                                   scale=scale, deterministic=deterministic)
