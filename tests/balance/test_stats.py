"""Cost models and the two measures."""

from __future__ import annotations

import numpy as np
import pytest

from gem_platform.balance import BalanceTracker, StepBalance, batch_work, measure_step
from gem_platform.balance.stats import padding_waste, straggler_overhead, straggler_overheads


def test_padding_waste_gem_example() -> None:
    # lengths 100, 300, 500, 1000: padding to 1000 computes 4000 positions for 1900 real ones
    assert padding_waste(np.array([100, 300, 500, 1000])) == pytest.approx(1 - 1900 / 4000)
    assert padding_waste(np.array([7, 7, 7])) == 0.0
    assert padding_waste(np.array([], dtype=np.int64)) == 0.0


def test_straggler_overhead() -> None:
    assert straggler_overhead(np.array([115.0, 95.0, 95.0, 95.0])) == pytest.approx(0.15)
    assert straggler_overhead(np.array([3.0, 3.0])) == 0.0
    per_step = straggler_overheads(np.array([[1.0, 3.0], [2.0, 2.0]]))
    assert per_step.tolist() == pytest.approx([0.5, 0.0])


def test_cost_models() -> None:
    lengths = np.array([10, 20, 30])
    assert batch_work(lengths, np.array([0, 2]), "length") == 40.0
    # L^2 + 6 * d * L with d = 4: (100 + 240) + (900 + 720)
    assert batch_work(lengths, np.array([0, 2]), "attention", model_dim=4) == 1960.0


def test_tracker_summarizes_steps_single_process() -> None:
    tracker = BalanceTracker()
    step = measure_step(np.array([100, 300, 500, 1000]), local_work=1900.0)
    assert step.rank_work.tolist() == [1900.0]  # no process group: just this rank
    assert step.straggler_overhead == 0.0
    metrics = tracker.record(step)
    assert metrics["balance/padding_waste"] == pytest.approx(0.525)
    tracker.record(StepBalance(rank_work=np.array([2.0, 1.0, 1.0, 0.0]), padding_waste=0.1))
    summary = tracker.summary()
    assert summary["balance/straggler_overhead_max"] == pytest.approx(1.0)
    assert summary["balance/straggler_overhead_mean"] == pytest.approx(0.5)
    assert summary["balance/padding_waste_mean"] == pytest.approx(0.3125)
