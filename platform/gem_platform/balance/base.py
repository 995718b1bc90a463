"""What every batcher shares: the epoch permutation, the step count, the tail rule, resume.

A batcher runs on one data-parallel rank over that rank's own samples and never
communicates. ``epoch(e)`` yields local full batches as arrays of positions into the rank's
``seq_lengths``; the caller maps them to its own sample ids.

Step count. Every rank must take the same number of steps per epoch, but ranks may hold
different numbers of samples. The caller computes the common count once with
``common_steps_per_epoch`` (the global minimum of ``n_rank // local_batch_size``) and passes it
as ``steps_per_epoch``; without it a batcher takes ``n // local_batch_size`` steps.

Tail rule. Let S be the step count and ``n`` the rank's samples. The epoch's permutation is
split in two: its first ``S * local_batch_size`` samples are batched (and, with BBS,
balanced); the remaining ``n - S * local_batch_size`` are the tail. With ``drop_last=False``
the tail is split into S near-equal runs and run ``s`` is appended to batch ``s``, so every
sample is seen exactly once per epoch and batches hold ``local_batch_size`` or a few more
samples. With ``drop_last=True`` the tail is skipped; with ``shuffle=True`` a different tail is
skipped each epoch.

Shuffling. The permutation is drawn from (seed, rank, epoch): ranks holding similar data
still draw different orders.

Resume. The permutation and every BBS buffer are pure functions of (seed, rank, epoch), so the
state is just (epoch, position): ``load_state_dict`` makes the next ``epoch(e)`` call for the
same epoch regenerate the plan and continue at batch ``position``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import numpy as np

from gem_platform.balance.config import LoaderConfig
from gem_platform.balance.cost import sample_work
from gem_platform.errors import DataError, GemError

STATE_VERSION = 1


class LoaderStateError(GemError):
    """A saved loader state does not belong to this loader configuration or data."""


def common_steps_per_epoch(samples_per_rank: Sequence[int], local_batch_size: int) -> int:
    """Steps every rank can take: the global minimum of ``n_rank // local_batch_size``."""
    if not len(samples_per_rank):
        raise DataError("No ranks were given.", "Pass one sample count per rank.")
    steps = min(int(n) for n in samples_per_rank) // local_batch_size
    if steps < 1:
        raise DataError(
            f"A rank holds {min(samples_per_rank)} samples, fewer than one local batch "
            f"(loader.local_batch_size = {local_batch_size}).",
            "Lower loader.local_batch_size, use fewer ranks, or add data.",
        )
    return steps


class Batcher(ABC):
    """Turns one rank's samples into ``len(self)`` local full batches per epoch."""

    def __init__(
        self,
        cfg: LoaderConfig,
        seq_lengths: np.ndarray,
        steps_per_epoch: int | None = None,
        rank: int = 0,
    ) -> None:
        lengths = np.asarray(seq_lengths)
        if lengths.ndim != 1:
            raise DataError(
                f"seq_lengths must be one length per sample (1-D), got shape {lengths.shape}.",
                "Pass the sequence length column of the rank's samples.",
            )
        if lengths.size and (not np.issubdtype(lengths.dtype, np.number) or lengths.min() < 0):
            raise DataError("seq_lengths holds negative or non-numeric values.",
                            "Check the sequence length column of the data.")
        self.cfg = cfg
        self.rank = int(rank)
        self.num_samples = int(lengths.size)
        if steps_per_epoch is None:
            steps_per_epoch = common_steps_per_epoch([self.num_samples], cfg.local_batch_size)
        if steps_per_epoch < 1 or steps_per_epoch * cfg.local_batch_size > self.num_samples:
            raise DataError(
                f"steps_per_epoch = {steps_per_epoch} needs "
                f"{steps_per_epoch * cfg.local_batch_size} samples per rank "
                f"(loader.local_batch_size = {cfg.local_batch_size}), but this rank holds "
                f"{self.num_samples}.",
                "Compute it with common_steps_per_epoch over all ranks' sample counts.",
            )
        self.steps_per_epoch = int(steps_per_epoch)
        self.work = sample_work(lengths, cfg.cost, cfg.model_dim)
        self._epoch = 0
        self._position = 0
        self._resume: tuple[int, int] | None = None

    def __len__(self) -> int:
        return self.steps_per_epoch

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's sample order: deterministic in (seed, rank, epoch)."""
        if not self.cfg.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        rng = np.random.default_rng([self.cfg.seed, self.rank, epoch])
        return rng.permutation(self.num_samples).astype(np.int64)

    def epoch(self, epoch: int) -> Iterator[np.ndarray]:
        """Yield the epoch's local full batches (int64 positions into ``seq_lengths``)."""
        start = 0
        if self._resume is not None and self._resume[0] == epoch:
            start = self._resume[1]
        self._resume = None
        self._epoch, self._position = epoch, start
        return self._iterate(epoch, start)

    def _iterate(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        perm = self.permutation(epoch)
        used = self.steps_per_epoch * self.cfg.local_batch_size
        tail = perm[used:]
        runs = (np.array_split(tail, self.steps_per_epoch)
                if tail.size and not self.cfg.drop_last else None)
        for step, batch in self._batches(perm[:used], start):
            if runs is not None and runs[step].size:
                batch = np.concatenate([batch, runs[step]])
            self._position = step + 1
            yield batch

    @abstractmethod
    def _batches(self, order: np.ndarray, start: int) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (step, indices) for steps ``start..len-1`` from the epoch's batched samples
        (``order`` holds exactly ``len(self) * local_batch_size`` positions)."""

    def state_dict(self) -> dict:
        """Epoch and position (batches already handed out), plus what identifies the plan."""
        return {
            "version": STATE_VERSION,
            "batching": self.cfg.batching,
            "seed": self.cfg.seed,
            "rank": self.rank,
            "num_samples": self.num_samples,
            "steps_per_epoch": self.steps_per_epoch,
            "epoch": self._epoch,
            "position": self._position,
        }

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``epoch(state['epoch'])`` continue at batch ``state['position']``."""
        mine = self.state_dict()
        for key in ("version", "batching", "seed", "rank", "num_samples", "steps_per_epoch"):
            if state.get(key) != mine[key]:
                raise LoaderStateError(
                    f"The saved loader state has {key} = {state.get(key)!r}, this loader has "
                    f"{mine[key]!r}.",
                    "Resume with the same loader section, data and world size as the run "
                    "that saved the checkpoint.",
                )
        position = int(state["position"])
        if not 0 <= position <= self.steps_per_epoch:
            raise LoaderStateError(f"The saved loader position {position} is outside the "
                                   f"epoch's {self.steps_per_epoch} steps.",
                                   "Use the checkpoint's unmodified loader state.")
        self._epoch, self._position = int(state["epoch"]), position
        self._resume = (self._epoch, position)
