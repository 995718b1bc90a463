"""GEM kernels: Triton kernels for jagged attention, GDPA, block attention and FP8 block-scaled
matmuls, each with its pure PyTorch reference beside it.

Every public op takes ``kernel=`` (:class:`Kernel`); by default it picks Triton on CUDA and the
PyTorch reference elsewhere (:func:`resolve_kernel`). The attention ops take
``deterministic=``; :func:`set_deterministic_backward` sets it for the whole process (see
gem_kernels.dispatch). This package imports only torch and triton.
"""

from gem_kernels.dispatch import (
    Kernel,
    deterministic_backward,
    resolve_kernel,
    set_deterministic_backward,
)

__all__ = ["Kernel", "deterministic_backward", "resolve_kernel", "set_deterministic_backward"]
