"""Batchers over a rolling window: what a rank can do while it streams its share.

The rank's stream is its pieces (row-group slices of its Parquet shards) in a seeded order,
pass after pass: pass ``p`` visits every piece once, in the order ``piece_order(seed, p,
rank)``. A window (pool) holds at most ``window`` samples: it starts with the stream's first
``window`` samples, each step takes one batch out of it and refills it with the next samples of
the stream, shuffled as they arrive. So a reader never holds more than ``window`` samples, and
the first step needs one window read, not the share. Every sample is taken exactly once per
pass; a sample may wait in the window for a few steps, so the last samples of a pass can be
taken in the first steps of the next one (the window rolls over pass boundaries instead of
draining, which would leave the rank's last batches of every pass to whatever is left).

- ``ShuffleBufferBatcher`` (``batching: sequential`` with a window): each batch is
  ``local_batch_size`` samples drawn at random from the window: a plain streaming loader.
- ``PackingBatcher`` (``batching: bbs_v2``, BBS v2): each batch is packed to the dataset's
  expected work per batch, ``local_batch_size * expected_work`` (the mean work of a sample
  under the cost model, from the dataset's metadata). Its size is the number of window samples
  that carry that work on average (within ``SIZE_SLACK`` of ``local_batch_size``); it starts
  from the window's oldest samples and swaps members for window samples of the right weight
  until the work matches. Samples that don't fit wait for later batches. Every rank's step work
  lands on the same target with no communication, whether its share is light or heavy.

``epoch(e)`` yields steps ``e * len(self)`` to ``(e + 1) * len(self) - 1`` of this one plan
(``len(self)`` from base.py's step count). The plan is a pure function of (seed, rank) and
the lengths; ``state_dict`` holds the window itself, so resume continues exactly without
replaying the steps before it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from gem_platform.balance.base import STATE_VERSION, Batcher, LoaderStateError
from gem_platform.balance.config import LoaderConfig
from gem_platform.errors import DataError

MAX_SWAPS = 256  # per batch; far above what a window of a few batches needs
# The window when the loader section sets none (the share is in memory): packing needs a few
# batches to choose from, and each step sorts the window, so a whole share would cost more.
DEFAULT_WINDOW_BATCHES = 8
SIZE_SLACK = 0.125  # a packed batch holds local_batch_size * (1 +- this) samples at most


def pass_pieces(num_pieces: int, seed: int, epoch: int, rank: int, shuffle: bool = True
                ) -> np.ndarray:
    """The order pass ``epoch`` of rank ``rank`` reads its pieces in (a seeded permutation)."""
    if not shuffle:
        return np.arange(num_pieces)
    return np.random.default_rng([seed, rank, epoch, 1]).permutation(num_pieces)


def piece_order(pieces: np.ndarray, num_samples: int, seed: int, epoch: int, rank: int,
                shuffle: bool = True) -> np.ndarray:
    """One pass's stream: positions of every sample, pieces in a seeded order.

    ``pieces`` holds the first position of each piece (ascending, starting at 0); piece ``i``
    spans ``pieces[i]:pieces[i+1]`` (the last one runs to ``num_samples``).
    """
    starts = np.asarray(pieces, dtype=np.int64)
    if starts.size == 0 or num_samples == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.append(starts[1:], num_samples)
    order = pass_pieces(starts.size, seed, epoch, rank, shuffle)
    return np.concatenate([np.arange(starts[i], ends[i], dtype=np.int64) for i in order])


class RollingBatcher(Batcher):
    """A window of at most ``cfg.window_samples`` samples that each step draws a batch from."""

    def __init__(self, cfg: LoaderConfig, seq_lengths: np.ndarray,
                 steps_per_epoch: int | None = None, rank: int = 0,
                 pieces: np.ndarray | None = None,
                 expected_work: float | None = None) -> None:
        super().__init__(cfg, seq_lengths, steps_per_epoch, rank)
        self.seq_lengths = np.asarray(seq_lengths)
        self.pieces = np.zeros(1, dtype=np.int64) if pieces is None else np.asarray(pieces)
        if self.pieces.size and (self.pieces[0] != 0 or np.any(np.diff(self.pieces) <= 0)
                                 or self.pieces[-1] >= max(self.num_samples, 1)):
            raise DataError("pieces must be ascending first positions of non-empty pieces, "
                            "starting at 0.", "Pass the reader's piece starts unchanged.")
        window = cfg.window_samples or DEFAULT_WINDOW_BATCHES * cfg.local_batch_size
        self.window = min(window, self.num_samples)
        self.max_batch = int(cfg.local_batch_size * (1 + SIZE_SLACK))
        self.min_batch = max(1, int(np.ceil(cfg.local_batch_size * (1 - SIZE_SLACK))))
        if self.window < cfg.local_batch_size:
            raise DataError(
                f"The window ({self.window} samples) can't hold a local batch of "
                f"{cfg.local_batch_size} samples.",
                "Set loader.window_samples to several local batches (8 or more pack well), "
                "or add data.")
        self.max_batch = min(self.max_batch, self.window)
        # mean work of a sample: the dataset's, from its metadata; else this rank's share
        share_mean = float(self.work.mean()) if self.num_samples else 0.0
        self.expected_work = float(expected_work) if expected_work else share_mean
        # lengths sort faster as small integers; every cost model grows with the length
        small = self.seq_lengths.size and self.seq_lengths.max() < 2**15
        self._sort_key = self.seq_lengths.astype(np.int16 if small else np.int64)
        self._reset()

    # -- the stream and its state ----------------------------------------------------------

    def _reset(self) -> None:
        self._step = 0  # global step the next batch is for
        self._pass = 0  # pass the stream cursor is in
        self._cursor = 0  # position in that pass's stream
        self._stream = self.pass_stream(0)
        self._pool = np.zeros(0, dtype=np.int64)
        self._deferred = np.zeros(0, dtype=np.int64)  # next pass's copies of waiting samples
        self._waiting = np.zeros(self.num_samples, dtype=bool)  # in the window now
        self._fill(self.window)

    def pass_stream(self, p: int) -> np.ndarray:
        """Positions of pass ``p``, in reading order."""
        return piece_order(self.pieces, self.num_samples, self.cfg.seed, p, self.rank,
                           self.cfg.shuffle)

    def _fill(self, count: int, rng: np.random.Generator | None = None) -> None:
        """Append the stream's next ``count`` samples to the pool, shuffled."""
        fresh = [self._deferred]
        count -= self._deferred.size
        while count > 0:
            if self._cursor >= self._stream.size:
                self._pass += 1
                self._cursor = 0
                self._stream = self.pass_stream(self._pass)
            part = self._stream[self._cursor : self._cursor + count]
            self._cursor += part.size
            count -= part.size
            fresh.append(part)
        rng = rng or np.random.default_rng([self.cfg.seed, self.rank, self._step, 3])
        incoming = rng.permutation(np.concatenate(fresh))
        # a sample of the next pass waits until its copy from this pass has left the window
        waiting = self._waiting[incoming]
        self._deferred = incoming[waiting]
        self._waiting[incoming[~waiting]] = True
        self._pool = np.concatenate([self._pool, incoming[~waiting]])

    def next_batch(self) -> np.ndarray:
        """The next step's batch (positions), taken out of the window, which is refilled."""
        rng = np.random.default_rng([self.cfg.seed, self.rank, self._step, 2])
        take = self._pick(self._pool, rng)
        batch = self._pool[take]
        self._waiting[batch] = False
        keep = np.ones(self._pool.size, dtype=bool)
        keep[take] = False
        self._pool = self._pool[keep]
        self._step += 1
        self._fill(self.window - self._pool.size, rng)
        return batch

    @property
    def pending(self) -> np.ndarray:
        """Samples read from the stream and not yet batched: the window, then the next pass's
        copies waiting for their earlier copy to leave it. A reader must hold these rows."""
        return np.concatenate([self._pool, self._deferred])

    @property
    def cursor(self) -> tuple[int, int]:
        """(pass, samples of that pass's stream read so far)."""
        return self._pass, self._cursor

    def _iterate(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        first = epoch * self.steps_per_epoch + start
        if first < self._step:
            self._reset()  # an earlier step than the window holds: replay from the start
        while self._step < first:
            self.next_batch()
        for step in range(start, self.steps_per_epoch):
            batch = self.next_batch()
            self._position = step + 1
            yield batch

    def _batches(self, order: np.ndarray, start: int) -> Iterator[tuple[int, np.ndarray]]:
        raise NotImplementedError("a rolling batcher plans its own stream (see next_batch)")

    def _pick(self, pool: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Which entries of ``pool`` (oldest first) form the next batch."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """base.py's state plus the window, so resume needs no replay."""
        state = super().state_dict()
        state.update(window_step=self._step, window_pass=self._pass,
                     window_cursor=self._cursor, window=self._pool.tolist(),
                     window_deferred=self._deferred.tolist())
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        try:
            step, p = int(state["window_step"]), int(state["window_pass"])
            cursor, pool = int(state["window_cursor"]), np.asarray(state["window"], np.int64)
            deferred = np.asarray(state["window_deferred"], np.int64)
        except (KeyError, TypeError, ValueError) as err:
            raise LoaderStateError(
                f"The saved loader state has no valid streaming window ({err}).",
                "Resume with the same loader section as the run that saved the checkpoint "
                f"(state version {STATE_VERSION}).") from None
        if step != self._epoch * self.steps_per_epoch + self._position:
            raise LoaderStateError(
                f"The saved window is at step {step}, the saved position at step "
                f"{self._epoch * self.steps_per_epoch + self._position}.",
                "Use the checkpoint's unmodified loader state.")
        if pool.size and (pool.min() < 0 or pool.max() >= self.num_samples):
            raise LoaderStateError("The saved window holds positions outside this rank's "
                                   "samples.", "Use the checkpoint's unmodified loader state.")
        self._step, self._pass, self._cursor, self._pool = step, p, cursor, pool
        self._deferred = deferred
        self._waiting = np.zeros(self.num_samples, dtype=bool)
        self._waiting[pool] = True
        self._stream = self.pass_stream(p)


class ShuffleBufferBatcher(RollingBatcher):
    """Each batch is ``local_batch_size`` samples drawn uniformly from the window."""

    def _pick(self, pool: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return np.sort(rng.choice(pool.size, size=self.cfg.local_batch_size, replace=False))


class PackingBatcher(RollingBatcher):
    """BBS v2: each batch packed to the expected work of a batch (see the module docstring)."""

    @property
    def target(self) -> float:
        """Work every batch is packed to: ``local_batch_size * expected_work``."""
        return self.cfg.local_batch_size * self.expected_work

    def _pick(self, pool: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        work = self.work[pool]
        mean = float(work.mean()) if work.size else 0.0
        b = round(self.target / mean) if mean > 0 else self.cfg.local_batch_size
        b = int(min(max(b, self.min_batch), self.max_batch, pool.size))
        return pack(work, self._sort_key[pool], b, self.target)


def pack(work: np.ndarray, sort_key: np.ndarray, b: int, target: float,
         tolerance: float = 1e-4) -> np.ndarray:
    """Positions of ``b`` entries of ``work`` whose sum is close to ``target``.

    Starts from the first ``b`` entries (the window's oldest) and swaps a member for the
    non-member whose work best closes the remaining gap, the members that can move the sum
    most first, until the gap is under ``tolerance * target`` or no swap helps.
    ``sort_key`` orders entries like ``work`` (the history length) and sorts faster.
    """
    m = work.size
    chosen = np.arange(b)
    if b >= m:
        return chosen
    rest = np.arange(b, m)
    by_work = rest[np.argsort(sort_key[rest], kind="stable")]
    rest_work = work[by_work]
    taken = np.zeros(by_work.size, dtype=bool)
    gap = float(work[:b].sum()) - target
    tol = tolerance * max(abs(target), 1.0)
    # members that can close a positive gap most are the heaviest, a negative one the lightest
    members = np.argsort(work[:b], kind="stable")
    used = np.zeros(b, dtype=bool)
    heavy, light = b - 1, 0  # cursors into ``members``: next heaviest / lightest unused
    for _ in range(MAX_SWAPS):
        if abs(gap) <= tol:
            break
        if gap > 0:
            while heavy >= 0 and used[members[heavy]]:
                heavy -= 1
            if heavy < 0:
                break
            j = int(members[heavy])
        else:
            while light < b and used[members[light]]:
                light += 1
            if light >= b:
                break
            j = int(members[light])
        x = float(work[j])
        k = _closest_free(rest_work, taken, x - gap)
        if k < 0:
            break
        y = float(rest_work[k])
        if abs(gap - (x - y)) >= abs(gap):
            break  # the member that moves the sum most can't help: none can
        taken[k] = True
        used[j] = True
        chosen[j] = by_work[k]
        gap -= x - y
    return chosen


def _closest_free(sorted_work: np.ndarray, taken: np.ndarray, want: float) -> int:
    """Index of the untaken entry of ``sorted_work`` closest to ``want`` (-1 if none)."""
    n = sorted_work.size
    k = int(np.searchsorted(sorted_work, want))
    lo, hi = k - 1, k
    while lo >= 0 and taken[lo]:
        lo -= 1
    while hi < n and taken[hi]:
        hi += 1
    if lo < 0 and hi >= n:
        return -1
    if lo < 0:
        return hi
    if hi >= n:
        return lo
    return lo if want - sorted_work[lo] <= sorted_work[hi] - want else hi
