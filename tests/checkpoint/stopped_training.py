"""One rank's training with a checkpoint store that can stop the run right after a chosen
step's checkpoint, as a crash would: the shared set-up of the sharded and reshard tests."""

from __future__ import annotations

from pathlib import Path

from gem_platform.checkpoint.store import LocalStore
from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train


class Stop(Exception):
    """Raised by the store after the checkpoint of the step to stop at."""


def train_until(tree: dict, root: str, stop_at: int, rank: int, every: int = 1) -> list[float]:
    """Train per ``tree`` with a checkpoint every ``every`` steps under ``root`` (resuming from
    the newest there); with ``stop_at``, stop right after that step's checkpoint. Returns the
    step losses on rank 0, nothing on the others."""
    losses: list[float] = []
    store = LocalStore(Path(root), every=every, keep=10)
    if stop_at:
        commit = store.commit

        def commit_then_stop(folder, step, metrics):
            commit(folder, step, metrics)
            if step == stop_at:
                raise Stop

        store.commit = commit_then_stop  # type: ignore[method-assign]
    sink = (lambda m, s: losses.append(m["train/loss"]) if "train/loss" in m else None)
    try:
        train(recipe_from_dict(tree), sink=sink if rank == 0 else None, echo=lambda _: None,
              checkpoints=store)
    except Stop:
        pass
    return losses
