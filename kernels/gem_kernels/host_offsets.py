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

import threading
import weakref
from collections import OrderedDict

import torch


class HostCopies:
    """Bounded LRU of device tensor -> host copy, confirmed by a weak reference to the device
    tensor and its version counter (the offsets are recognised by identity, as in
    gdpa.schedule.ScheduleCache). ``ignore_cpu``: a CPU tensor needs no host copy; tests turn
    it off to exercise the lookup without a GPU."""

    def __init__(self, size: int = 64, ignore_cpu: bool = True) -> None:
        self._entries: OrderedDict[int, tuple[weakref.ref, int, torch.Tensor]] = OrderedDict()
        self._size, self._ignore_cpu = size, ignore_cpu
        self._lock = threading.RLock()  # the prefetcher and the model may run on two threads

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, device_t: torch.Tensor, host_t: torch.Tensor) -> None:
        if self._ignore_cpu and device_t.device.type == "cpu":
            return
        if host_t.device.type != "cpu" or host_t.shape != device_t.shape:
            raise ValueError(f"need a CPU tensor of shape {tuple(device_t.shape)}; got "
                             f"{host_t.device.type} {tuple(host_t.shape)}")
        key = id(device_t)
        # A private copy: later in-place writes to the caller's host tensor cannot leak in.
        entry = (weakref.ref(device_t, lambda ref, key=key: self._drop(key, ref)),
                 device_t._version, host_t.detach().clone())
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)

    def get(self, device_t: torch.Tensor) -> torch.Tensor | None:
        """The host copy of ``device_t`` if it is the remembered object, unmodified; else
        None."""
        key = id(device_t)
        with self._lock:
            hit = self._entries.get(key)
            if hit is None or hit[0]() is not device_t or device_t._version != hit[1]:
                return None
            self._entries.move_to_end(key)
            return hit[2]

    def _drop(self, key: int, ref: weakref.ref) -> None:
        """The device tensor died: forget its entry (unless the id was reused meanwhile)."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] is ref:
                del self._entries[key]


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
