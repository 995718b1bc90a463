"""Parameters sharing one gradient buffer (as a compiled backward can hand them) get their own
copies before any in-place update; clipping then scales each gradient exactly once."""

from __future__ import annotations

import math

import torch
from torch import nn

from gem_platform.parallel.clip import clip_grad_norm
from gem_platform.train.shared_grads import separate_shared_grads


def _params(n: int, size: int = 4) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(size)) for _ in range(n)]


def test_exact_duplicates_are_copied_others_untouched():
    a, b, c, d = _params(4)
    shared = torch.arange(4.0)
    a.grad, b.grad, c.grad = shared, shared.view(4), shared.as_strided((4,), (1,), 0)
    d.grad = torch.ones(4)
    own_d = d.grad
    assert separate_shared_grads([a, b, c, d]) == 2
    assert a.grad is shared and d.grad is own_d
    ptrs = {p.grad.data_ptr() for p in (a, b, c)}
    assert len(ptrs) == 3
    for p in (a, b, c):
        assert torch.equal(p.grad, torch.arange(4.0))


def test_distinct_views_of_one_bucket_stay_views():
    a, b = _params(2, size=3)
    bucket = torch.arange(6.0)
    a.grad, b.grad = bucket[:3], bucket[3:]
    assert separate_shared_grads([a, b]) == 0
    assert a.grad.untyped_storage().data_ptr() == b.grad.untyped_storage().data_ptr()


def test_parameters_without_gradient_are_skipped():
    a, b = _params(2)
    assert separate_shared_grads([a, b]) == 0
    assert a.grad is None and b.grad is None


def test_clipping_scales_each_separated_gradient_once():
    """Without separation the multi-tensor scale would touch the shared memory once per
    parameter (coef**3 here, and on CUDA concurrently); after it, exactly coef."""
    params = _params(3)
    shared = torch.full((4,), 2.0)
    for p in params:
        p.grad = shared
    separate_shared_grads(params)
    norm = clip_grad_norm(params, [], None, max_norm=1.0)
    total = math.sqrt(3 * 4 * 2.0**2)
    assert math.isclose(float(norm), total, rel_tol=1e-6)
    coef = 1.0 / (total + 1e-6)
    for p in params:
        torch.testing.assert_close(p.grad, torch.full((4,), 2.0 * coef))
