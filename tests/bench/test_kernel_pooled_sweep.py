"""The pooled-attention backward plan sweep (gem_bench.kernels.gdpa_pooled_sweep): its grid,
its K/V lengths and summary, its refusal without CUDA, and (GPU) one shape timed on every
plan."""

from __future__ import annotations

import pytest
import torch

from gem_kernels.testing import offsets_from_lengths


def test_pooled_sweep_grid_lengths_and_summary() -> None:
    from gem_bench.kernels.common import BenchRow
    from gem_bench.kernels.gdpa_pooled_sweep import PLANS, grid, kv_lengths, summary

    shapes = grid()
    assert len(shapes) == 3 * 4 * 2 * 2 and len({s.name for s in shapes}) == len(shapes)
    assert {s.q_rows for s in shapes} == {1, 4, 16, 64} and {s.batch for s in shapes} == {
        64, 256, 1024}
    lengths = kv_lengths(1024)
    assert min(lengths) >= 16 and max(lengths) <= 2048 and 300 < sum(lengths) / 1024 < 500
    assert kv_lengths(256) == kv_lengths(256)  # every shape of a batch size sees the same K/V

    def row(case: str, plan: str, ms: float, gpu: float | None) -> BenchRow:
        return BenchRow(case, plan, "bwd", ms, extra={"ms_gpu": gpu, "default": "short_q",
                                                      "balance": 0.4})

    rows = [row("a", "short_q", 0.4, 0.16), row("a", "short_q_stream", 0.3, 0.2),
            row("a", "two_kernel", 0.2, 0.24), row("b", "short_q", 0.5, None),
            row("b", "two_kernel", 0.25, None)]
    got = {s["case"]: s for s in summary(rows)}
    # by GPU time where taken (eager time can be the host's launch cost), else eager time
    assert got["a"]["fastest"] == "short_q" and got["a"]["default_over_fastest"] == 1.0
    assert got["b"]["fastest"] == "two_kernel"
    assert got["b"]["default_over_fastest"] == pytest.approx(2.0)
    assert PLANS == ("short_q", "short_q_stream", "two_kernel")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pooled_sweep_refuses_without_cuda(tmp_path) -> None:
    from gem_bench.kernels.deterministic import main

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--pooled-sweep", "--out", str(tmp_path)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pooled_sweep_shape_times_every_plan() -> None:
    """One small sweep shape: a row per plan with eager and GPU times, the atomic-free plans
    bitwise repeatable, and the default the op picks named on every row."""
    from gem_bench.kernels.gdpa_pooled_sweep import PLANS, Shape, kv_lengths, measure_shape

    lengths = kv_lengths(64)
    g = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16,
                        generator=g) for _ in range(2))
    rows = measure_shape(Shape(64, 4, 4, 64), k, v, offsets_from_lengths(lengths, "cuda"),
                         max(lengths), warmup_ms=2, rep_ms=5)
    assert [r.variant for r in rows] == list(PLANS)
    for r in rows:
        assert r.ms > 0 and r.extra["ms_gpu"] and r.extra["default"] == "short_q"
        if r.variant != "short_q":
            assert r.extra["bitwise_repeatable"]
