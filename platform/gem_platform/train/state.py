"""What the training loop carries from step to step, and what a checkpoint keeps of it.

``LoopState`` is the loop's own progress (step, last loss, time and FLOP totals, balance and
running-NE accumulators, the held-out learning curve); ``CheckpointExtras`` is everything a
rank saves beside the model and optimizer state (see gem_platform.checkpoint.store) so that a
resumed run continues exactly where the saved one stood.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from gem_platform.balance.stats import BalanceTracker
from gem_platform.train.learning import LearningCurve
from gem_platform.train.metrics import normalized_entropy


@dataclass
class Totals:
    """Sums over a span of steps: useful FLOPs, compute and step seconds, samples (all ranks)."""

    flops: float = 0.0
    compute_s: float = 0.0
    step_s: float = 0.0
    samples: float = 0.0
    steps: int = 0

    def add(self, flops: float, compute_s: float, step_s: float, samples: float) -> None:
        self.flops += flops
        self.compute_s += compute_s
        self.step_s += step_s
        self.samples += samples
        self.steps += 1


class RunningNE:
    """Train-time NE over the samples since the last report (the progress line's NE)."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.pos = 0.0
        self.count = 0

    def update(self, ctr_loss: float, positives: float, n: int) -> None:
        """Add a batch of ``n`` samples, ``positives`` of them clicked, at mean CTR loss
        ``ctr_loss``."""
        self.loss += ctr_loss * n
        self.pos += positives
        self.count += n

    def pop(self) -> float:
        """NE since the last ``pop``; starts a new span."""
        value = normalized_entropy(self.loss / max(self.count, 1), self.pos / max(self.count, 1))
        self.__init__()
        return value


@dataclass
class LoopState:
    """The loop's progress after ``step`` steps.

    ``totals`` covers every step; ``window`` the steps since the last progress line;
    ``steady`` the steps after each process's warm-up (kernel compilation and autotuning),
    which the final QPS and MFU use."""

    step: int = 0
    last_loss: float = math.nan
    totals: Totals = field(default_factory=Totals)
    window: Totals = field(default_factory=Totals)
    steady: Totals = field(default_factory=Totals)
    balance: BalanceTracker = field(default_factory=BalanceTracker)
    running: RunningNE = field(default_factory=RunningNE)
    compiles_after_warmup: int = 0  # graphs and kernels compiled past the warm-up steps
    since_eval: RunningNE = field(default_factory=RunningNE)  # train NE since the last eval
    curve: LearningCurve = field(default_factory=LearningCurve)  # held-out evaluations

    def __setstate__(self, saved: dict[str, Any]) -> None:
        """Unpickle (a checkpoint); fields added since the checkpoint was written start fresh."""
        fresh = {f.name: (f.default if f.default_factory is MISSING else f.default_factory())
                 for f in fields(self) if f.name not in saved}
        self.__dict__.update({**fresh, **saved})


@dataclass
class CheckpointExtras:
    """A rank's part of a checkpoint beside model and optimizer state: the loop's progress,
    the batcher's position (``Batcher.state_dict``) and the LR schedulers' states (one per
    optimizer, in the loop's optimizer order)."""

    loop: LoopState
    loader: dict[str, Any]
    schedulers: list[dict[str, Any]]

    @property
    def epoch(self) -> int:
        """The epoch the batcher continues in."""
        return int(self.loader["epoch"])
