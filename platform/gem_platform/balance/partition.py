"""Balanced partition with equal item counts: LPT dealt round by round.

Used twice: by BBS to deal base-batch pairs to the full batches of its buffer, and as the
global upper bound, where one step's samples of all ranks are repartitioned across ranks
(what a balancer with an all-to-all could reach). Every part must receive the same number of
items (a rank's local batch size is fixed), so plain LPT does not apply; instead the items,
sorted heaviest first, are dealt in rounds of one item per part, and in each round the
heaviest item goes to the currently lightest part. The first two rounds are a snake deal;
later rounds keep correcting the running imbalance. Cost: one sort plus ``rounds`` sorts of
the part loads, all vectorized.
"""

from __future__ import annotations

import numpy as np


def lpt_rounds(
    work: np.ndarray, parts: int, loads: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Deal items to ``parts`` parts, one item per part per round.

    ``work`` must hold a multiple of ``parts`` items. ``loads`` (optional) are the parts'
    starting loads. Returns (part id of each item, final loads).
    """
    work = np.asarray(work, dtype=np.float64)
    if parts < 1 or work.size % parts:
        raise ValueError(f"{work.size} items can't be dealt evenly to {parts} parts")
    loads = np.zeros(parts) if loads is None else np.array(loads, dtype=np.float64)
    order = np.argsort(-work, kind="stable")
    assign = np.empty(work.size, dtype=np.int64)
    for r in range(work.size // parts):
        items = order[r * parts : (r + 1) * parts]  # heaviest first
        targets = np.argsort(loads, kind="stable")  # lightest first
        assign[items] = targets
        loads[targets] += work[items]
    return assign, loads


def balanced_partition(work: np.ndarray, parts: int) -> np.ndarray:
    """Part id of each item; parts get equal counts (within one when not divisible)."""
    work = np.asarray(work, dtype=np.float64)
    pad = (-work.size) % parts
    padded = np.concatenate([work, np.zeros(pad)]) if pad else work
    assign, _ = lpt_rounds(padded, parts)
    return assign[: work.size]


def partition_loads(work: np.ndarray, assign: np.ndarray, parts: int) -> np.ndarray:
    """Total work of each part."""
    return np.bincount(assign, weights=np.asarray(work, dtype=np.float64), minlength=parts)
