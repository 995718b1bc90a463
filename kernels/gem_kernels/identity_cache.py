"""A bounded cache keyed by tensors' identity: what was computed from some tensors (a schedule
from offsets, the host copy of device offsets) is handed back while the same tensor objects
come back unmodified.

Looked up by the tensors' ids (one dict probe), confirmed by weak references and version
counters (an in-place write bumps ``_version``); least recently used first out, and an entry
goes as soon as one of its tensors is freed. Thread-safe: the prefetcher and the model may
use it from two threads.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

import torch

V = TypeVar("V")


class IdentityCache(Generic[V]):
    """``value`` per (``key``, tensors), valid while those tensor objects live unmodified."""

    def __init__(self, size: int) -> None:
        self._entries: OrderedDict[tuple, tuple[tuple[weakref.ref, ...], tuple[int, ...], V]] \
            = OrderedDict()
        self._size = size
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, tensors: tuple[torch.Tensor, ...]) -> V | None:
        full = (key, *map(id, tensors))
        with self._lock:
            hit = self._entries.get(full)
            if hit is None:
                return None
            refs, versions, value = hit
            if any(r() is not t for r, t in zip(refs, tensors, strict=True)) or \
                    versions != tuple(t._version for t in tensors):
                return None
            self._entries.move_to_end(full)
            return value

    def put(self, key: Hashable, tensors: tuple[torch.Tensor, ...], value: V) -> None:
        full = (key, *map(id, tensors))
        refs = tuple(weakref.ref(t, lambda ref, full=full: self._drop(full, ref))
                     for t in tensors)
        with self._lock:
            self._entries[full] = (refs, tuple(t._version for t in tensors), value)
            self._entries.move_to_end(full)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)

    def _drop(self, full: tuple, ref: weakref.ref) -> None:
        """A tensor of the entry died: forget it (unless its ids were reused meanwhile)."""
        with self._lock:
            hit = self._entries.get(full)
            if hit is not None and ref in hit[0]:
                del self._entries[full]
