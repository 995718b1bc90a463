"""GEM kernels: Triton kernels for jagged attention, GDPA, block attention and FP8 block-scaled
matmuls, each with its pure PyTorch reference beside it.

Every public op takes ``kernel=`` (:class:`Kernel`); by default it picks Triton on CUDA and the
PyTorch reference elsewhere (:func:`resolve_kernel`). The attention ops take
``deterministic=``; :func:`set_deterministic_backward` sets it for the whole process (see
gem_kernels.dispatch). Offsets copied to the device with :func:`host_to_device` (or recorded
by :func:`remember_host_copy`) are read back by the host-side schedules without a device sync
(gem_kernels.host_offsets). This package imports only torch and triton.
"""

from gem_kernels.dispatch import (
    Kernel,
    deterministic_backward,
    resolve_kernel,
    set_deterministic_backward,
)

# (host_offsets itself is not re-exported: it would shadow its module's name here)
from gem_kernels.host_offsets import host_to_device, remember_host_copy

__all__ = ["Kernel", "deterministic_backward", "host_to_device", "remember_host_copy",
           "resolve_kernel", "set_deterministic_backward"]
