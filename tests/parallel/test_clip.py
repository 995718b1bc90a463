"""Global-norm clipping scales every gradient on the device, by exactly 1 below the limit."""

import math

import torch
from torch import nn

from gem_platform.parallel.clip import clip_grad_norm


def _params(*grads: list[float], dtype=torch.float32) -> list[nn.Parameter]:
    out = []
    for g in grads:
        p = nn.Parameter(torch.zeros(len(g), dtype=dtype))
        p.grad = torch.tensor(g, dtype=dtype)
        out.append(p)
    return out


def test_gradients_above_the_limit_are_scaled_to_it():
    dense = _params([3.0, 0.0], [0.0, 4.0])  # global norm 5
    experts = _params([0.0], dtype=torch.bfloat16)
    norm = clip_grad_norm(dense, experts, None, max_norm=1.0)
    assert norm.item() == 5.0 and norm.dtype == torch.float32
    assert torch.allclose(dense[0].grad, torch.tensor([0.6, 0.0]), atol=1e-6)
    assert torch.allclose(dense[1].grad, torch.tensor([0.0, 0.8]), atol=1e-6)
    total = math.sqrt(sum(float(p.grad.double().square().sum()) for p in dense))
    assert abs(total - 1.0) < 1e-5


def test_gradients_below_the_limit_or_without_one_are_unchanged():
    dense = _params([0.3, 0.4])
    before = dense[0].grad.clone()
    assert abs(clip_grad_norm(dense, [], None, max_norm=1.0).item() - 0.5) < 1e-6
    assert torch.equal(dense[0].grad, before)
    assert abs(clip_grad_norm(dense, [], None, max_norm=float("inf")).item() - 0.5) < 1e-6
    assert torch.equal(dense[0].grad, before)
