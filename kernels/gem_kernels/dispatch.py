"""The rules every op shares: which implementation runs (its Triton kernel or its PyTorch
reference), whether its backward must be bitwise reproducible, and the one dtype of its
operands.

Kernel choice (:func:`resolve_kernel`): Triton where it can run and supports the inputs, else
the PyTorch reference, unless the caller insisted on Triton, which then raises instead of
silently running the reference.

Deterministic backward (:func:`deterministic_backward`): one process-wide switch,
:func:`set_deterministic_backward`, that a training loop sets from its own setting (e.g. a
recipe's ``train.deterministic``). With the switch left at ``None`` (the default) it follows
``torch.are_deterministic_algorithms_enabled()``, so ``torch.use_deterministic_algorithms(True)``
alone turns it on. An op's own ``deterministic=`` argument, when given, overrides both. In
deterministic mode a backward uses no floating-point atomics (whose order changes a sum's last
bits): the same inputs on the same GPU give bitwise-identical gradients. Otherwise each op
runs its fastest backward.
"""

from __future__ import annotations

import enum
import os

import torch


class Kernel(str, enum.Enum):
    """Which implementation of an op runs."""

    AUTO = "auto"
    TRITON = "triton"
    PYTORCH = "pytorch"


def interpreting() -> bool:
    """Whether Triton runs under its CPU interpreter (``TRITON_INTERPRET=1``): the one place
    that reads the switch, so kernels, tests and tools agree on what it means. Read at each
    call, since a process may set it before it first imports triton."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available_on(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, or anywhere under the interpreter (TRITON_INTERPRET=1)."""
    if interpreting():
        return True
    return device.type == "cuda"


def resolve_kernel(kernel: Kernel | str | None, *tensors: torch.Tensor,
                   unsupported: str | None = None, op: str = "this op") -> Kernel:
    """The one fallback rule: TRITON or PYTORCH for an op's call.

    ``kernel`` None/'auto': TRITON when every tensor is on CUDA and ``unsupported`` is None,
    else PYTORCH. 'pytorch': PYTORCH. 'triton': TRITON, or a RuntimeError when it cannot run
    here (tensors off CUDA without TRITON_INTERPRET=1) or ``unsupported`` names why the op's
    Triton kernel cannot take these inputs, so that a benchmark never silently times the
    reference. ``unsupported``: the op's reason in words (e.g. "takes head_dim 16..256, got
    12"), None when its kernel takes the inputs. ``op``: the op's name, for the messages.
    """
    try:
        k = Kernel(kernel) if kernel is not None else Kernel.AUTO
    except ValueError:
        raise ValueError(f"{op}: kernel={kernel!r} is not one of "
                         f"{[m.value for m in Kernel]}") from None
    if k is Kernel.PYTORCH:
        return k
    if k is Kernel.AUTO:
        on_cuda = all(t.device.type == "cuda" for t in tensors)
        return Kernel.TRITON if on_cuda and unsupported is None else Kernel.PYTORCH
    if not all(triton_available_on(t.device) for t in tensors):
        raise RuntimeError(
            f"{op}: kernel='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU "
            "interpreter); use kernel='pytorch' or 'auto' for the reference.")
    if unsupported is not None:
        raise RuntimeError(f"{op}: kernel='triton' was asked for, but its Triton kernel "
                           f"{unsupported}; use kernel='pytorch' or 'auto' for the reference.")
    return k


_DETERMINISTIC_BACKWARD: bool | None = None


def set_deterministic_backward(enabled: bool | None) -> None:
    """Process-wide switch for every op's backward: True forces the deterministic (atomic-free)
    backward, False the fast one, None (the default) follows
    ``torch.are_deterministic_algorithms_enabled()``. Ops read it when their forward runs."""
    global _DETERMINISTIC_BACKWARD
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_deterministic_backward takes True, False or None; got {enabled!r}")
    _DETERMINISTIC_BACKWARD = enabled


def deterministic_backward(requested: bool | None = None) -> bool:
    """Whether a backward must be bitwise reproducible: ``requested`` (an op's
    ``deterministic=`` argument) when not None, else the process-wide switch when set, else
    ``torch.are_deterministic_algorithms_enabled()``."""
    if requested is not None:
        return bool(requested)
    if _DETERMINISTIC_BACKWARD is not None:
        return _DETERMINISTIC_BACKWARD
    return torch.are_deterministic_algorithms_enabled()


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
