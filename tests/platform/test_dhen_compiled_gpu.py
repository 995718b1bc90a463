"""A compiled DHEN layer's backward on CUDA, at recipes/h200.yaml's shapes: bitwise the same
from run to run however the allocator's free memory was left, as close to the fp32 eager
gradient as bf16 eager is, and clipped gradients (shared bias gradients separated first)
repeat too. Autograd's own backward of the dot interaction's bmm(t, t^T) made Inductor emit a
reduction that reloaded its own stores under another thread layout: its input gradient was
off by up to 28% and changed every run (docs/bench/determinism_h200_dhen_race.json)."""

from __future__ import annotations

import pytest
import torch

from gem_platform.model.interaction import DhenLayer
from gem_platform.parallel.clip import clip_grad_norm
from gem_platform.train.determinism import deterministic_mode
from gem_platform.train.shared_grads import separate_shared_grads

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SAMPLES, TOKENS, DIM, EXPERTS, HIDDEN = 1024, 16, 256, 4, 1024


def _fill_free_memory(value: float) -> None:
    """Leave the caching allocator's free blocks (large and small pool) holding ``value``."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    big = torch.full((1 << 29,), value, device="cuda")
    small = [torch.full((1 << 17,), value, device="cuda") for _ in range(500)]
    del big, small
    torch.cuda.synchronize()


def test_compiled_dhen_backward_repeats_and_matches_eager():
    with deterministic_mode(0):
        layer = DhenLayer(TOKENS, DIM, EXPERTS, HIDDEN).cuda()
        gen = torch.Generator(device="cuda").manual_seed(1)
        x0 = torch.randn(SAMPLES, TOKENS, DIM, device="cuda", generator=gen)
        grad_out = torch.randn(SAMPLES, TOKENS, DIM, device="cuda", generator=gen)
        x = x0.clone().requires_grad_(True)
        layer(x).backward(grad_out)  # fp32 eager: the reference
        reference = x.grad.clone()
        compiled = torch.compile(layer.forward, backend="inductor", dynamic=True)
        warm = torch.randn(SAMPLES // 2, TOKENS, DIM, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            compiled(warm).sum().backward()
        runs = []
        for value in (0.0, 1.0, 0.0):
            _fill_free_memory(value)
            layer.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = compiled(x)
            out.backward(grad_out)
            separate_shared_grads(layer.parameters())
            clip_grad_norm(list(layer.parameters()), [], None, max_norm=1e-3)
            runs.append([x.grad.clone(), *(p.grad.clone() for p in layer.parameters())])
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)
    error = float((runs[0][0] - reference).norm() / reference.norm())
    assert error < 2e-3, f"compiled input gradient {error:.2%} from fp32 eager"
