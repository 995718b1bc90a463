"""GEM kernels: Triton kernels for jagged attention, GDPA, block attention and FP8 block-scaled
matmuls, each with its pure PyTorch reference beside it.

Every public op takes ``kernel=`` (:class:`Kernel`); by default it picks Triton on CUDA and the
PyTorch reference elsewhere. This package imports only torch and triton.
"""

from gem_kernels.dispatch import Kernel, resolve_kernel

__all__ = ["Kernel", "resolve_kernel"]
