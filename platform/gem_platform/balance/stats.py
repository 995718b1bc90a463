"""The two numbers every run measures: padding waste and straggler overhead.

Padding waste says whether jagged kernels pay (compute a padded layout would spend on pad
positions); straggler overhead says whether batch balancing pays (how much longer the slowest
rank works than the average one, which every synchronous step waits for).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def padding_waste(lengths: np.ndarray) -> float:
    """1 - real tokens / (B * max_len): the fraction of a padded batch that is padding."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if lengths.size == 0:
        return 0.0
    longest = float(lengths.max())
    if longest <= 0:
        return 0.0
    return 1.0 - float(lengths.sum()) / (lengths.size * longest)


def straggler_overhead(per_rank_work: np.ndarray) -> float:
    """max / mean - 1 across ranks at one step (0 = perfectly balanced)."""
    work = np.asarray(per_rank_work, dtype=np.float64)
    if work.size == 0:
        return 0.0
    mean = float(work.mean())
    if mean <= 0:
        return 0.0
    return float(work.max()) / mean - 1.0


def straggler_overheads(work_by_step: np.ndarray) -> np.ndarray:
    """Straggler overhead of every step of a (steps, ranks) work matrix."""
    work = np.asarray(work_by_step, dtype=np.float64)
    mean = work.mean(axis=1)
    safe = np.where(mean > 0, mean, 1.0)
    return np.where(mean > 0, work.max(axis=1) / safe - 1.0, 0.0)


@dataclass(frozen=True)
class Summary:
    """Mean, p95 and max of a per-step measure over a run."""

    mean: float
    p95: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float] | np.ndarray) -> Summary:
        arr = np.asarray(values, dtype=np.float64)
        if arr.size == 0:
            return cls(0.0, 0.0, 0.0)
        return cls(float(arr.mean()), float(np.percentile(arr, 95)), float(arr.max()))


@dataclass(frozen=True)
class StepBalance:
    """What one training step records about balance (all ranks' view, identical on each)."""

    rank_work: np.ndarray  # (world,) work of each rank's local batch
    padding_waste: float  # of this rank's local batch

    @property
    def straggler_overhead(self) -> float:
        return straggler_overhead(self.rank_work)

    def metrics(self) -> dict[str, float]:
        """Per-step metrics under stable names, ready for MLflow ``log_metrics``."""
        return {
            "balance/straggler_overhead": self.straggler_overhead,
            "balance/padding_waste": self.padding_waste,
            "balance/rank_work_max": float(self.rank_work.max()),
            "balance/rank_work_mean": float(self.rank_work.mean()),
        }


@dataclass
class BalanceTracker:
    """Accumulates StepBalance records over a run and summarizes them at the end."""

    straggler: list[float] = field(default_factory=list)
    padding: list[float] = field(default_factory=list)

    def record(self, step: StepBalance) -> dict[str, float]:
        self.straggler.append(step.straggler_overhead)
        self.padding.append(step.padding_waste)
        return step.metrics()

    def summary(self) -> dict[str, float]:
        """Run-level metrics: mean / p95 / max of both measures."""
        out: dict[str, float] = {}
        for name, values in (("straggler_overhead", self.straggler),
                             ("padding_waste", self.padding)):
            s = Summary.of(values)
            out[f"balance/{name}_mean"] = s.mean
            out[f"balance/{name}_p95"] = s.p95
            out[f"balance/{name}_max"] = s.max
        return out


def gather_rank_work(local_work: float) -> np.ndarray:
    """All ranks' work at this step, via one scalar all-gather (measurement only).

    Without an initialized process group this returns just the local value, so the same call
    works in single-process runs (and costs no torch import when torch was never loaded).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return np.array([float(local_work)])
    import torch

    world = dist.get_world_size()
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mine = torch.tensor([float(local_work)], dtype=torch.float64, device=device)
    everyone = torch.empty(world, dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(everyone, mine)
    return everyone.cpu().numpy()


def measure_step(seq_lengths: np.ndarray, local_work: float) -> StepBalance:
    """Gather the ranks' work and compute this rank's padding waste for one step."""
    return StepBalance(rank_work=gather_rank_work(local_work),
                       padding_waste=padding_waste(seq_lengths))
