"""Balanced partition with equal item counts: LPT dealt round by round.

Used twice: by BBS to deal base-batch pairs to the full batches of its buffer, and as the
global upper bound, where one step's samples of all ranks are repartitioned across ranks
(what a balancer with an all-to-all could reach). Every part must receive the same number of
items (a rank's local batch size is fixed), so plain LPT does not apply; instead the items,
sorted heaviest first, are dealt in rounds of one item per part, and in each round the
heaviest item goes to the currently lightest part. The first two rounds are a snake deal;
later rounds keep correcting the running imbalance. Cost: one sort plus ``rounds`` sorts of
the part loads, all vectorized.

For many rounds (the global partition deals a whole step's samples), ``balanced_partition``
snake-deals all but the last ``LPT_TAIL_ROUNDS`` rounds in one vectorized pass and runs LPT
only on those last rounds, which hold the lightest items and so can correct whatever
imbalance the snake left down to their own size.
"""

from __future__ import annotations

import numpy as np

LPT_TAIL_ROUNDS = 64


def lpt_rounds(
    work: np.ndarray,
    parts: int,
    loads: np.ndarray | None = None,
    order: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Deal items to ``parts`` parts, one item per part per round.

    ``work`` must hold a multiple of ``parts`` items. ``loads`` (optional) are the parts'
    starting loads; ``order`` (optional) is the items heaviest first, when the caller can sort
    faster (e.g. by small integer lengths, which numpy radix-sorts). Returns (part id of each
    item, final loads).
    """
    work = np.asarray(work, dtype=np.float64)
    if parts < 1 or work.size % parts:
        raise ValueError(f"{work.size} items can't be dealt evenly to {parts} parts")
    loads = np.zeros(parts) if loads is None else np.array(loads, dtype=np.float64)
    if order is None:
        order = np.argsort(-work, kind="stable")
    assign = np.empty(work.size, dtype=np.int64)
    for r in range(work.size // parts):
        items = order[r * parts : (r + 1) * parts]  # heaviest first
        targets = np.argsort(loads)  # lightest first (introsort: deterministic)
        assign[items] = targets
        loads[targets] += work[items]
    return assign, loads


def balanced_partition(
    work: np.ndarray, parts: int, order: np.ndarray | None = None
) -> np.ndarray:
    """Part id of each item; parts get equal counts (within one when not divisible).

    ``order`` (optional): the items heaviest first.
    """
    work = np.asarray(work, dtype=np.float64)
    pad = (-work.size) % parts
    if pad:
        if order is not None:  # padding items weigh 0, so they come last
            order = np.concatenate([order, np.arange(work.size, work.size + pad)])
        work = np.concatenate([work, np.zeros(pad)])
    if order is None:
        order = np.argsort(-work, kind="stable")
    rounds = work.size // parts
    snake_rounds = max(0, rounds - LPT_TAIL_ROUNDS)
    head = snake_rounds * parts
    assign = np.empty(work.size, dtype=np.int64)
    lane = np.arange(parts)
    snake = np.where((np.arange(snake_rounds) % 2 == 0)[:, None], lane, parts - 1 - lane)
    assign[order[:head]] = snake.reshape(-1)
    loads = np.bincount(assign[order[:head]], weights=work[order[:head]], minlength=parts)
    tail = order[head:]
    tail_assign, _ = lpt_rounds(work[tail], parts, loads=loads,
                                order=np.arange(tail.size))
    assign[tail] = tail_assign
    return assign[: work.size - pad]


def descending_order(lengths: np.ndarray) -> np.ndarray:
    """Positions of ``lengths`` (non-negative integers) longest first; radix-sorted when they
    fit in int16, which is much faster than a float sort of the same items."""
    lengths = np.asarray(lengths)
    if lengths.size and np.issubdtype(lengths.dtype, np.integer) and lengths.max() < 2**15:
        lengths = lengths.astype(np.int16, copy=False)
    return np.argsort(lengths, kind="stable")[::-1]


def partition_loads(work: np.ndarray, assign: np.ndarray, parts: int) -> np.ndarray:
    """Total work of each part."""
    return np.bincount(assign, weights=np.asarray(work, dtype=np.float64), minlength=parts)
