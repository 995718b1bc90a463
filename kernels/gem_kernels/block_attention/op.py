"""Public block attention op: Triton kernels on CUDA, PyTorch reference elsewhere."""

from __future__ import annotations

import math

import torch

from gem_kernels.block_attention.reference import block_attention_reference, check_inputs
from gem_kernels.block_attention.rope import Rope
from gem_kernels.dispatch import Kernel, resolve_kernel, same_dtype


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                    *, block: int = 64, rope: Rope | None = None, scale: float | None = None,
                    causal: bool = False, kernel: Kernel | str | None = None) -> torch.Tensor:
    """Softmax attention within fixed ``block``-token blocks of each jagged sequence.

    q, k, v: (total_tokens, heads, head_dim) bf16/fp16 (fp32 runs on the reference); offsets:
    int64 (B+1,). Every sequence is cut into ``block``-token blocks from its first token (the
    last may be partial); each query attends to all keys of its own block (``causal=True``:
    only keys at or before it). ``rope`` (RopeConfig(base) or RopeTables(cos, sin)) rotates q
    and k by position within the sequence inside the kernel (tables rounded to the input dtype
    there; RopeTables must cover every position used). ``scale`` defaults to
    1/sqrt(head_dim). ``kernel``: None/'auto' (Triton on CUDA, reference elsewhere), 'triton'
    or 'pytorch'. Returns (total_tokens, heads, head_dim) in the operands' common dtype
    (autocast's inside an autocast region).
    """
    q, k, v = same_dtype(q, k, v)
    check_inputs(q, k, v, offsets, block)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    which = resolve_kernel(kernel, q, k, v)
    if which is Kernel.PYTORCH:
        return block_attention_reference(q, k, v, offsets, block=block, rope=rope, scale=scale,
                                         causal=causal)
    from gem_kernels.block_attention.autograd import block_attention_triton, triton_supported

    if not triton_supported(q, block):
        if kernel is not None and Kernel(kernel) is Kernel.TRITON:
            raise RuntimeError(f"the Triton block attention kernel does not support dtype "
                               f"{q.dtype} / head_dim {q.shape[-1]} / block {block}")
        return block_attention_reference(q, k, v, offsets, block=block, rope=rope, scale=scale,
                                         causal=causal)
    return block_attention_triton(q, k, v, offsets, block=block, rope=rope, scale=scale,
                                  causal=causal)
