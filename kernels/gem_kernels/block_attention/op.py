"""Public block attention op: Triton kernels on CUDA, PyTorch reference elsewhere."""

from __future__ import annotations

import math

import torch

from gem_kernels.block_attention.reference import block_attention_reference, check_inputs
from gem_kernels.block_attention.rope import Rope
from gem_kernels.dispatch import Kernel, deterministic_backward, resolve_kernel, same_dtype


def triton_unsupported(q: torch.Tensor, block: int) -> str | None:
    """Why the Triton kernels cannot take these inputs (they take fp16/bf16, head_dim 64 or
    128 and block 64), or None when they can."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"takes fp16/bf16 inputs, not {q.dtype}"
    if q.shape[-1] not in (64, 128):
        return f"takes head_dim 64 or 128, not {q.shape[-1]}"
    if block != 64:
        return f"takes block 64, not {block}"
    return None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                    *, block: int = 64, rope: Rope | None = None, scale: float | None = None,
                    causal: bool = False, kernel: Kernel | str | None = None,
                    deterministic: bool | None = None) -> torch.Tensor:
    """Softmax attention within fixed ``block``-token blocks of each jagged sequence.

    q, k, v: (total_tokens, heads, head_dim) bf16/fp16 (fp32 runs on the reference); offsets:
    int64 (B+1,). Every sequence is cut into ``block``-token blocks from its first token (the
    last may be partial); each query attends to all keys of its own block (``causal=True``:
    only keys at or before it). ``rope`` (RopeConfig(base) or RopeTables(cos, sin)) rotates q
    and k by position within the sequence inside the kernel (tables rounded to the input dtype
    there; RopeTables must cover every position used). ``scale`` defaults to
    1/sqrt(head_dim). ``kernel``: None/'auto' (Triton on CUDA, reference elsewhere), 'triton'
    or 'pytorch'. ``deterministic`` (None: gem_kernels.dispatch.deterministic_backward()):
    the Triton backward writes each (block, head) gradient from one program, with no atomics,
    so it is bitwise reproducible either way; deterministic mode also keeps the default
    launch settings where the autotuner is on (autograd.use_autotune). Returns
    (total_tokens, heads, head_dim) in the operands' common dtype (autocast's inside an
    autocast region).
    """
    q, k, v = same_dtype(q, k, v)
    check_inputs(q, k, v, offsets, block)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    which = resolve_kernel(kernel, q, k, v, unsupported=triton_unsupported(q, block),
                           op="block_attention")
    if which is Kernel.PYTORCH:
        return block_attention_reference(q, k, v, offsets, block=block, rope=rope, scale=scale,
                                         causal=causal)
    from gem_kernels.block_attention.autograd import block_attention_triton

    return block_attention_triton(q, k, v, offsets, block=block, rope=rope, scale=scale,
                                  causal=causal,
                                  deterministic=deterministic_backward(deterministic))
