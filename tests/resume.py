"""Train a recipe, crash it after a given step, resume it from its checkpoints: the sequence
every exact-resume test compares against an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from gem_platform.checkpoint.store import LocalStore, latest_checkpoint
from gem_platform.recipe import Recipe
from gem_platform.train.loop import RunSummary, train

Losses = list[tuple[int, float]]


class Crash(Exception):
    """Raised from the metric sink to stop a run as a killed process would."""


def losses_of(recipe: Recipe) -> tuple[Losses, RunSummary]:
    """(step, loss) of every step of one uninterrupted run, and its summary."""
    out: Losses = []
    summary = train(recipe, sink=lambda m, s: out.append((s, m["train/loss"]))
                    if "train/loss" in m else None, echo=lambda _: None)
    return out, summary


def crash_and_resume(recipe: Recipe, ckpts: Path, *, every: int, keep: int, crash_after: int,
                     expect_checkpoint: int) -> tuple[Losses, RunSummary]:
    """Run until ``crash_after`` is published, check the newest checkpoint is step
    ``expect_checkpoint``, resume; the losses as the run's record holds them and the summary."""
    logged: Losses = []

    def crashing_sink(metrics, step):
        if "train/loss" in metrics:
            logged.append((step, metrics["train/loss"]))
            if step == crash_after:
                raise Crash

    store = LocalStore(ckpts, every=every, keep=keep)
    with pytest.raises(Crash):
        train(recipe, sink=crashing_sink, echo=lambda _: None, checkpoints=store)
    assert latest_checkpoint(ckpts).name == f"step_{expect_checkpoint:08d}"
    # The resumed run replays the steps after its checkpoint; what the record already holds is
    # not published again.
    summary = train(recipe, sink=lambda m, s: logged.append((s, m["train/loss"]))
                    if "train/loss" in m else None, echo=lambda _: None, checkpoints=store,
                    published_through=max(s for s, _ in logged))
    return logged, summary
