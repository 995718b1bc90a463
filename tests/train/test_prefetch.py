"""The input prefetcher: batches collated on a background thread, handed out in order, the
source's errors surfaced, the thread stopped on close; on CUDA the copies are pinned and
overlapped on a side stream."""

from __future__ import annotations

import threading
from dataclasses import fields

import numpy as np
import pytest
import torch

from gem_platform.train.prefetch import Prefetcher


def _source(meta, make_batch, n: int, threads: list[str] | None = None, fail_at: int = -1):
    for i in range(n):
        if threads is not None:
            threads.append(threading.current_thread().name)
        if i == fail_at:
            raise ValueError(f"bad sample file at batch {i}")
        yield make_batch(meta, [3 + i, 1, 0, 7], seed=i), np.arange(4) + 4 * i


def _same(a, b) -> None:
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x.cpu(), y.cpu(), rtol=0, atol=0)
        elif x is not None:
            torch.testing.assert_close(x.values().cpu(), y.values().cpu(), rtol=0, atol=0)


def test_batches_in_order_collated_off_the_training_thread(tiny_meta, batch_factory):
    threads: list[str] = []
    want = list(_source(tiny_meta, batch_factory, 5))
    with Prefetcher(_source(tiny_meta, batch_factory, 5, threads), torch.device("cpu")) as pf:
        got = list(pf)
    assert len(got) == 5
    for (b, i), (wb, wi) in zip(got, want, strict=True):
        _same(b, wb)
        np.testing.assert_array_equal(i, wi)
        assert b.max_seq_len == wb.max_seq_len
    assert set(threads) == {"gem-collate"}
    with pytest.raises(StopIteration):
        next(pf)


def test_source_errors_surface_in_the_training_thread(tiny_meta, batch_factory):
    pf = Prefetcher(_source(tiny_meta, batch_factory, 5, fail_at=2), torch.device("cpu"))
    next(pf), next(pf)
    with pytest.raises(ValueError, match="batch 2"):
        next(pf)
    assert not pf._thread.is_alive()


def test_close_stops_an_endless_source(tiny_meta, batch_factory):
    def endless():
        i = 0
        while True:
            yield batch_factory(tiny_meta, [2, 2], seed=i), np.arange(2)
            i += 1

    pf = Prefetcher(endless(), torch.device("cpu"), depth=2)
    next(pf)
    pf.close()
    assert not pf._thread.is_alive()
    with pytest.raises(ValueError, match="depth=0"):
        Prefetcher(endless(), torch.device("cpu"), depth=0)


@pytest.mark.gpu
def test_cuda_batches_are_copied_ahead_on_a_side_stream(tiny_meta, batch_factory):
    want = list(_source(tiny_meta, batch_factory, 4))
    device = torch.device("cuda")
    with Prefetcher(_source(tiny_meta, batch_factory, 4), device) as pf:
        first, _ = next(pf)
        assert pf._next is not None  # the second batch's copy is already issued
        got = [first] + [b for b, _ in pf]
    for b, (wb, _) in zip(got, want, strict=True):
        assert b.seq_offsets.is_cuda and b.sparse.values().is_cuda
        assert b.max_seq_len == wb.max_seq_len
        _same(b, wb)
