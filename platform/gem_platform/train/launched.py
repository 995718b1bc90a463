"""A training step queued on the device and read back later, so the host never waits for it.

On CUDA a step's kernels are launched without a single host sync: its timings are CUDA events
on the compute stream and its scalars (loss, per-task losses, gradient norm, positives) are
copied into pinned host memory behind it. The loop reads a step back (``LaunchedStep.settle``)
only once the next step's forward is queued, or at once where the host needs the value
(progress lines, evaluation, checkpoints, the last step). So the host builds step n+1 while
the GPU still runs step n, and per-step host overhead hides behind device work.

On CPU every operation has finished when it returns; the same marks are read from the host
clock and ``settle`` returns at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# Where ``LaunchedStep.scalars`` keeps each value.
LOSS, LOSS_CTR, LOSS_CVR, GRAD_NORM, POSITIVES = range(5)


class StepClock:
    """Marks points of a step on the device's own timeline: CUDA events on the current stream,
    or the host clock on CPU (where the timeline is the host's)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> torch.cuda.Event | float:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
        """Device time from ``start`` to ``end``; both must have completed (see ``wait``)."""
        if isinstance(start, float):
            return float(end) - start
        return start.elapsed_time(end) / 1e3

    @staticmethod
    def wait(mark: torch.cuda.Event | float) -> None:
        if not isinstance(mark, float):
            mark.synchronize()


@dataclass(frozen=True)
class StepResult:
    """One training step, read back: losses, gradient norm, useful FLOPs and two timings."""

    step: int
    loss: float
    task_losses: tuple[float, float]  # (ctr, cvr)
    grad_norm: float
    positives: float  # CTR positives in the batch (the running NE's base rate)
    flops: float
    compute_s: float  # the step less the sync of replicated gradients, on the device
    step_s: float  # wall time: from the step's launch, or the last step's read-back, to its own


@dataclass
class LaunchedStep:
    """A step whose kernels are queued. ``marks`` are (start, backward done, gradients synced,
    end); ``scalars`` the device values above, copied to ``host`` behind the step's work."""

    step: int
    clock: StepClock
    marks: tuple
    host: torch.Tensor
    flops: float
    launched_at: float  # host clock when the step began to launch
    logits: torch.Tensor  # kept for the divergence report
    loss: torch.Tensor

    @classmethod
    def queue(cls, step: int, clock: StepClock, marks: tuple, scalars: torch.Tensor,
              flops: float, launched_at: float, logits: torch.Tensor,
              loss: torch.Tensor) -> LaunchedStep:
        """Copy ``scalars`` to host memory without waiting for them (pinned, on CUDA)."""
        if clock.cuda:
            host = torch.empty(scalars.shape, dtype=scalars.dtype, pin_memory=True)
            host.copy_(scalars, non_blocking=True)
        else:
            host = scalars
        end = clock.mark()
        return cls(step, clock, (*marks, end), host, flops, launched_at, logits, loss)

    def settle(self, since: float) -> StepResult:
        """Wait for the step to finish and read it back. ``since`` is the host clock of the
        previous step's read-back; the step's wall time runs from the later of that and its
        own launch."""
        start, backward, synced, end = self.marks
        self.clock.wait(end)
        now = time.perf_counter()
        seconds = self.clock.seconds
        v = self.host.tolist()
        return StepResult(
            step=self.step, loss=v[LOSS], task_losses=(v[LOSS_CTR], v[LOSS_CVR]),
            grad_norm=v[GRAD_NORM], positives=v[POSITIVES], flops=self.flops,
            compute_s=seconds(start, backward) + seconds(synced, end),
            step_s=now - max(since, self.launched_at))
