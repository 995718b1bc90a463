"""Block-scaled FP8 training for linear layers: quantization (32x32 or 1x128/128x128 blocks,
optional random Hadamard and stochastic rounding), the FP8 GEMM, ``Fp8BlockLinear`` and
``Fp8RMSNormLinear`` (activation quantization fused into the norm); and the flat 1x128
format of FP8 saved activations (``quantize_blocks`` / ``dequantize_blocks``).

Every op takes ``kernel=`` (Triton on CUDA, the PyTorch reference elsewhere).
"""

from gem_kernels.fp8.blockwise import dequantize_blocks, quantize_blocks
from gem_kernels.fp8.gemm import gemm
from gem_kernels.fp8.linear import (
    Fp8BlockLinear,
    Fp8Config,
    fp8_block_linear,
    hadamard_for,
    quantize_weight,
)
from gem_kernels.fp8.norm_linear import Fp8RMSNormLinear
from gem_kernels.fp8.quantize import quantize, quantize_dual, rmsnorm_quantize
from gem_kernels.fp8.reference import (
    FP8_DTYPE,
    BlockFp8,
    apply_hadamard,
    dequantize_reference,
    gemm_reference,
    hadamard_matrix,
    quantize_reference,
    rmsnorm_quantize_reference,
)
from gem_kernels.fp8.tensor import Fp8BlockWeight

__all__ = [
    "FP8_DTYPE", "BlockFp8", "Fp8BlockLinear", "Fp8BlockWeight", "Fp8Config", "Fp8RMSNormLinear",
    "apply_hadamard", "dequantize_blocks", "dequantize_reference", "fp8_block_linear", "gemm",
    "gemm_reference", "hadamard_for", "hadamard_matrix", "quantize", "quantize_blocks",
    "quantize_dual", "quantize_reference",
    "quantize_weight",
    "rmsnorm_quantize", "rmsnorm_quantize_reference",
]
