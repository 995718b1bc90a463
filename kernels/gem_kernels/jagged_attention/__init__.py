"""Jagged flash attention (JFA): softmax attention on jagged (total_tokens, heads, head_dim)
tensors with int64 offsets, no padding; Triton forward and backward, PyTorch reference."""

from gem_kernels.jagged_attention.op import jagged_attention
from gem_kernels.jagged_attention.reference import jagged_attention_reference

__all__ = ["jagged_attention", "jagged_attention_reference"]
