"""64-token block attention with fused RoPE on jagged (total_tokens, heads, head_dim) tensors:
each query block attends only to its own key block. Triton forward and backward (RoPE applied
inside the kernels, its conjugate in the backward epilogue), PyTorch reference beside it."""

from gem_kernels.block_attention.op import block_attention
from gem_kernels.block_attention.reference import block_attention_reference
from gem_kernels.block_attention.rope import (
    RopeConfig,
    RopeTables,
    apply_rope_reference,
    build_rope_tables,
    rope_tables_for,
    sequence_positions,
)

__all__ = [
    "RopeConfig",
    "RopeTables",
    "apply_rope_reference",
    "block_attention",
    "block_attention_reference",
    "build_rope_tables",
    "rope_tables_for",
    "sequence_positions",
]
