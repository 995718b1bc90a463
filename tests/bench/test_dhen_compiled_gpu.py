"""A compiled DHEN layer's backward on CUDA, at recipes/h200.yaml's shapes
(``gem_bench.dhen_repeat``): bitwise the same from run to run however the allocator's free memory
was left, clipped gradients included, and as close to the fp32 eager gradient as bf16 eager
is. With autograd's own backward of the dot interaction's bmm(t, t^T), Inductor's kernel
reloaded its own stores unordered: the input gradient was up to 28% off and changed every run
(docs/bench/determinism_h200_dhen_race.json)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_compiled_dhen_backward_repeats_and_matches_eager():
    from gem_bench.dhen_repeat import measure

    result = measure("self", compiled=True)
    assert result["repeats"], f"gradients differ between runs: {result['differing']}"
    assert max(result["relative_error"]) < 2e-3, result["relative_error"]
