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


def same_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The operands of an attention op in one dtype, as a matmul would see them: autocast's
    dtype inside an autocast region, else the promoted type.

    Inside autocast, norms run in fp32 while linears give bf16, so a model hands q (after its
    QK-norm, or a learned fp32 query) and v in different dtypes; the kernels need one, and
    without this an fp32 q would quietly send the op to its reference. The casts are
    differentiable."""
    dtype = autocast_dtype(tensors[0])
    if dtype is None:
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
    return tuple(t.to(dtype) for t in tensors)


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs matmuls in on ``t``'s device, or None outside autocast."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
