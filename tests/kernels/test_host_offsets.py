"""Host copies of device offsets (gem_kernels.host_offsets) and the GDPA schedules that use
them: the registry hands a host copy back only for the same, unmodified tensor; a schedule
built from a remembered copy is the one built from the values; the forward builds the
backward's schedules, so the backward builds none.

The registry's default instance ignores CPU tensors (they need no copy), so its lookup is
exercised on a HostCopies that accepts them, and build_schedule's on ``meta`` tensors: they
hold no values, so a schedule built from one can only have come from its remembered copy.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from gem_kernels.dispatch import interpreting  # noqa: E402
from gem_kernels.gdpa import gdpa  # noqa: E402
from gem_kernels.gdpa.op import _CACHE  # noqa: E402
from gem_kernels.gdpa.schedule import build_schedule  # noqa: E402
from gem_kernels.host_offsets import (  # noqa: E402
    HOST_COPIES,
    HostCopies,
    host_offsets,
    remember_host_copy,
)
from gem_kernels.testing import offsets_from_lengths  # noqa: E402


def test_registry_returns_the_copy_only_for_the_same_unmodified_tensor() -> None:
    reg = HostCopies(ignore_cpu=False)
    dev, host = torch.tensor([0, 3, 7]), torch.tensor([0, 3, 7])
    reg.remember(dev, host)
    got = reg.get(dev)
    assert got is not None and torch.equal(got, host)
    host[1] = 99  # the registry keeps its own copy
    assert torch.equal(reg.get(dev), torch.tensor([0, 3, 7]))
    assert reg.get(torch.tensor([0, 3, 7])) is None  # equal values, another tensor
    dev[1] = 4  # in-place change: the copy no longer holds
    assert reg.get(dev) is None


def test_registry_forgets_freed_tensors_and_stays_bounded() -> None:
    reg = HostCopies(size=2, ignore_cpu=False)
    dev = torch.arange(4)
    reg.remember(dev, torch.arange(4))
    assert len(reg) == 1
    del dev
    gc.collect()
    assert len(reg) == 0
    keep = [torch.arange(3) for _ in range(3)]
    for t in keep:
        reg.remember(t, t.clone())
    assert len(reg) == 2 and reg.get(keep[0]) is None and reg.get(keep[2]) is not None
    with pytest.raises(ValueError, match="shape"):
        reg.remember(keep[0], torch.arange(5))


def test_default_registry_ignores_cpu_tensors() -> None:
    t = torch.tensor([0, 2, 5])
    before = len(HOST_COPIES)
    remember_host_copy(t, torch.tensor([0, 1, 1]))
    assert len(HOST_COPIES) == before
    assert host_offsets(t) is t


def test_schedule_from_remembered_copy_equals_schedule_from_values() -> None:
    rows = offsets_from_lengths([130, 0, 17, 64, 1, 300])
    cols = offsets_from_lengths([5, 40, 0, 64, 200, 9])
    ref = build_schedule(rows, cols, 64, 32, 2, 12, "cpu", num_sms=4)
    rows_m, cols_m = torch.empty_like(rows, device="meta"), torch.empty_like(cols, device="meta")
    remember_host_copy(rows_m, rows)
    remember_host_copy(cols_m, cols)
    got = build_schedule(rows_m, cols_m, 64, 32, 2, 12, "cpu", num_sms=4)
    assert torch.equal(got.items, ref.items) and torch.equal(got.prog_ptr, ref.prog_ptr)
    assert got.num_programs == ref.num_programs and torch.equal(got.work, ref.work)
    with pytest.raises(Exception):  # noqa: B017 - unknown offsets fall back to a real read
        build_schedule(torch.empty_like(rows, device="meta"), cols_m, 64, 32, 2, 12, "cpu")


@pytest.mark.skipif(not interpreting(), reason="CPU interpreter test")
@pytest.mark.parametrize("ql,kl,deterministic", [
    ([40, 17, 1, 0], [3, 1, 0, 2], False),      # cross: short_kv
    ([1, 3, 2, 0], [70, 0, 21, 4], False),      # pooled: short_q / short_q_stream
    ([70, 0, 5, 33], [66, 9, 0, 40], False),    # long: one_pass (untuned off the GPU)
    ([70, 0, 5, 33], [66, 9, 0, 40], True),     # long: two_kernel
])
def test_backward_finds_its_schedules_built_by_the_forward(ql, kl, deterministic) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 16, generator=g, requires_grad=True)
               for n in (sum(ql), sum(kl), sum(kl)))
    qo, ko = offsets_from_lengths(ql), offsets_from_lengths(kl)  # new objects: cache misses
    out = gdpa(q, k, v, qo, ko, max(ql), max(kl), kernel="triton",
               deterministic=deterministic)
    built = len(_CACHE)
    out.backward(torch.randn(out.shape, generator=g))
    assert len(_CACHE) == built, out.grad_fn.mode  # the backward built nothing
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
