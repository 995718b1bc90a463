"""Host copies of device offsets, so host-side schedule builders need not read the device.

The GDPA schedules are built on the host from the offsets; reading device offsets back
(``t.to("cpu")``) synchronises the stream and leaves the GPU idle while the host builds. The
offsets almost always started on the host (the batch's ``seq_offsets``, an ``arange``): whoever
copies them to the device records the pair here (:func:`remember_host_copy`, or
:func:`host_to_device` with ``remember=True``) and :func:`host_offsets` hands the host copy back
while the device tensor is the same object, unmodified (same ``_version``). Anything else
falls back to the copy (correct, with the sync).
"""

from __future__ import annotations

import torch

from gem_kernels.identity_cache import IdentityCache


class HostCopies:
    """Device tensor -> its host copy (gem_kernels.identity_cache: held while the device
    tensor is the same object, unmodified). ``ignore_cpu``: a CPU tensor needs no host copy;
    tests turn it off to exercise the lookup without a GPU."""

    def __init__(self, size: int = 64, ignore_cpu: bool = True) -> None:
        self._cache: IdentityCache[torch.Tensor] = IdentityCache(size)
        self._ignore_cpu = ignore_cpu

    def __len__(self) -> int:
        return len(self._cache)

    def remember(self, device_t: torch.Tensor, host_t: torch.Tensor) -> None:
        if self._ignore_cpu and device_t.device.type == "cpu":
            return
        if host_t.device.type != "cpu" or host_t.shape != device_t.shape:
            raise ValueError(f"need a CPU tensor of shape {tuple(device_t.shape)}; got "
                             f"{host_t.device.type} {tuple(host_t.shape)}")
        # A private copy: later in-place writes to the caller's host tensor cannot leak in.
        self._cache.put("host", (device_t,), host_t.detach().clone())

    def get(self, device_t: torch.Tensor) -> torch.Tensor | None:
        """The host copy of ``device_t`` if it is the remembered object, unmodified; else
        None."""
        return self._cache.get("host", (device_t,))


HOST_COPIES = HostCopies()


def remember_host_copy(device_offsets: torch.Tensor, host_offsets: torch.Tensor) -> None:
    """Record that ``device_offsets`` holds the values of the CPU tensor ``host_offsets``
    (no-op when ``device_offsets`` is on the CPU itself)."""
    HOST_COPIES.remember(device_offsets, host_offsets)


def host_offsets(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: itself on the CPU, its remembered host copy without a sync, else
    ``t.to("cpu")`` (a device-to-host copy that synchronises the stream)."""
    if t.device.type == "cpu":
        return t
    known = HOST_COPIES.get(t)
    return known if known is not None else t.to("cpu")


def host_to_device(host: torch.Tensor, device: torch.device | str,
                   remember: bool = False) -> torch.Tensor:
    """``host`` copied to ``device`` without a stream sync: on CUDA through pinned memory with
    non_blocking=True (the caching host allocator keeps the pinned block until the copy has
    run); elsewhere, and while a CUDA graph is captured, the plain copy. ``remember``: record
    the pair for :func:`host_offsets`."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        out = host.to(device)
    else:
        out = host.pin_memory().to(device, non_blocking=True)
    if remember:
        remember_host_copy(out, host)
    return out
