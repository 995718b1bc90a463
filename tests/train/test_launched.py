"""A launched step reads back the values and timings it was queued with (CPU clock)."""

import time

import torch

from gem_platform.train.launched import LaunchedStep, StepClock


def test_settle_reads_back_scalars_and_times_from_the_later_of_launch_and_last_read():
    clock = StepClock(torch.device("cpu"))
    launched_at = time.perf_counter()
    start = clock.mark()
    time.sleep(0.02)
    backward = clock.mark()
    synced = clock.mark()
    scalars = torch.tensor([0.7, 0.5, 0.2, 3.0, 11.0], dtype=torch.float64)
    step = LaunchedStep.queue(4, clock, (start, backward, synced), scalars, 1e9, launched_at,
                              torch.zeros(2, 2), torch.tensor(0.7))
    result = step.settle(since=launched_at - 100.0)  # the last read-back came before launch
    assert (result.step, result.loss, result.task_losses) == (4, 0.7, (0.5, 0.2))
    assert (result.grad_norm, result.positives, result.flops) == (3.0, 11.0, 1e9)
    assert 0.02 <= result.compute_s <= result.step_s < 5.0
    later = step.settle(since=time.perf_counter())  # read back after a later mark
    assert later.step_s < result.step_s
