"""Input overlapped with compute: batches collated on a background thread, in pinned host
memory, and copied to the GPU on a side stream while the previous batch trains.

``Prefetcher(source, device)`` wraps an iterator of host batches ``(JaggedBatch, indices)``
(the collate runs inside ``source``, so on the background thread) and yields them on
``device`` in the same order. On CUDA the copy of batch i+1 is issued on a side stream right
after batch i is handed out, so it runs while batch i trains; the training stream waits for
that copy before it uses the batch, and the copied tensors are recorded on the training stream
so the allocator does not reuse their memory early. On CPU the batches pass through unchanged
(the background thread still takes the collate off the training thread).

A handed-out batch carries its longest history and its token count as host ints
(``max_seq_len``, ``num_tokens``), read before the copy: the model reads both every step and
would otherwise sync with the GPU to get them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

import torch

from gem_platform.data.batch import JaggedBatch, remember_seq_offsets

HostBatch = tuple[JaggedBatch, Any]  # the batch and what travels with it (indices)


class PrefetchedBatch(JaggedBatch):
    """A JaggedBatch whose longest history and token count were read on the host before the
    copy."""

    _host_max_seq_len: int = 0
    _host_num_tokens: int = 0

    @property
    def max_seq_len(self) -> int:
        return self._host_max_seq_len

    @property
    def num_tokens(self) -> int:
        return self._host_num_tokens


def _host_max_len(batch: JaggedBatch) -> int:
    lengths = batch.seq_offsets[1:] - batch.seq_offsets[:-1]
    return int(lengths.max()) if lengths.numel() else 0


def pin(batch: JaggedBatch) -> JaggedBatch:
    """The batch with every tensor in page-locked host memory (asynchronous copies need it)."""
    out = {}
    for f in fields(batch):
        v = getattr(batch, f.name)
        out[f.name] = None if v is None else v.pin_memory()
    return JaggedBatch(**out)


def to_device(batch: JaggedBatch, device: torch.device, max_len: int) -> PrefetchedBatch:
    """Copy (non-blocking from pinned memory) onto ``device``, with the host-read max length."""
    moved = {}
    for f in fields(batch):
        v = getattr(batch, f.name)
        moved[f.name] = None if v is None else v.to(device, non_blocking=True)
    out = PrefetchedBatch(**moved)
    out._host_max_seq_len = max_len
    out._host_num_tokens = batch.num_tokens  # the host batch: no sync
    remember_seq_offsets(batch, out)  # GDPA's schedules read the offsets from the host copy
    return out


def _record_on(batch: JaggedBatch, stream: torch.cuda.Stream) -> None:
    """Tell the allocator the training stream uses the batch's side-stream allocations."""
    for f in fields(batch):
        v = getattr(batch, f.name)
        if v is not None:
            v.record_stream(stream)  # tensors and KeyedJaggedTensor alike


class _End:
    """Marks the end of the source (or carries its exception) through the queue."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class Prefetcher(Iterator[HostBatch]):
    """Host batches from ``source`` (``(batch, extra)`` pairs; ``extra`` is passed through
    untouched: the indices, a loader state; collated on a background thread, ``depth`` ahead, pinned
    on CUDA) handed out on ``device`` with the next copy in flight. ``close()`` stops the
    thread; the iterator closes itself at the end of ``source``. Exceptions raised by
    ``source`` surface from ``next()``."""

    def __init__(self, source: Iterator[HostBatch], device: torch.device,
                 depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth}: the prefetcher keeps at least one batch ready")
        self.device = device
        self.cuda = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._next: HostBatch | None = None
        self._done = False
        self._thread = threading.Thread(target=self._produce, args=(source,), daemon=True,
                                        name="gem-collate")
        self._thread.start()

    def _put(self, item: object) -> bool:
        """Queue ``item`` unless the consumer closed meanwhile; False once closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, source: Iterator[HostBatch]) -> None:
        try:
            for batch, indices in source:
                if not self._put((pin(batch) if self.cuda else batch, indices)):
                    return
            self._put(_End())
        except BaseException as err:  # handed to the training thread
            self._put(_End(err))
        finally:
            close = getattr(source, "close", None)
            if close is not None:  # a generator's cleanup runs here, on its own thread
                close()

    def _take(self) -> HostBatch:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _End):
            self._done = True
            self.close()
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def _issue_copy(self) -> None:
        """Start the next batch's copy on the side stream (CUDA), or just take it (CPU)."""
        batch, indices = self._take()
        if not self.cuda:
            self._next = (batch, indices)
            return
        assert self._stream is not None
        max_len = _host_max_len(batch)
        # The side stream must not copy into memory the training stream still reads.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._next = (to_device(batch, self.device, max_len), indices)

    def __next__(self) -> HostBatch:
        if self._next is None:
            self._issue_copy()
        batch, indices = self._next  # type: ignore[misc]
        self._next = None
        if self.cuda:
            assert self._stream is not None
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self._stream)
            _record_on(batch, main)
            try:
                self._issue_copy()  # batch i+1 copies while batch i trains
            except StopIteration:
                pass
        return batch, indices

    def close(self) -> None:
        """Stop the background thread (idempotent)."""
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
