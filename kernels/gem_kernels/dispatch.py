"""The one rule every op uses to choose between its Triton kernel and its PyTorch reference."""

from __future__ import annotations

import enum
import os

import torch


class Kernel(str, enum.Enum):
    """Which implementation of an op runs."""

    AUTO = "auto"
    TRITON = "triton"
    PYTORCH = "pytorch"


def triton_available_on(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, or anywhere under the interpreter (TRITON_INTERPRET=1)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda"


def resolve_kernel(kernel: Kernel | str | None, *tensors: torch.Tensor) -> Kernel:
    """AUTO/None -> TRITON when every tensor is on CUDA, else PYTORCH; explicit choices are kept.

    Asking for TRITON where it cannot run raises, so a benchmark never silently times the
    reference.
    """
    k = Kernel(kernel) if kernel is not None else Kernel.AUTO
    on_cuda = all(t.device.type == "cuda" for t in tensors)
    if k is Kernel.AUTO:
        return Kernel.TRITON if on_cuda else Kernel.PYTORCH
    if k is Kernel.TRITON and not all(triton_available_on(t.device) for t in tensors):
        raise RuntimeError(
            "kernel='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter); "
            "use kernel='pytorch' for the reference."
        )
    return k
