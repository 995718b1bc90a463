"""Profile a dataset's balance without training: padding waste and straggler overhead for
no balancing, BBS, and a global balanced partition (the upper bound).

The measurement every team should take first (GEM-NOTES, "recommended first step"): a large
padding waste says jagged kernels pay; a large straggler overhead says balance batches first.
Each rank's step time is taken as proportional to its batch work under the loader's cost
model, so the straggler overhead of a step is max / mean - 1 of the ranks' batch work.

- none: a plain shuffled loader, ``local_batch`` random samples per rank per step.
- bbs: the BBS batcher on each rank, exactly as training runs it (no communication).
- bbs_v2: BBS v2 on each rank (rolling.py): every batch packed from a rolling window to the
  dataset's expected work per batch (the global mean work per sample, which a rank reads from
  the dataset's metadata; no communication). Its window rolls over epoch ends, so its batches
  need not use every one of a rank's samples within the profiled steps.
- global: at every step, the samples all ranks consumed under "none" are repartitioned across
  ranks (LPT with equal counts, partition.py): what a balancer with a per-step all-to-all
  could reach.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from gem_platform.balance.base import common_steps_per_epoch
from gem_platform.balance.bbs import BBSBatcher
from gem_platform.balance.config import LoaderConfig
from gem_platform.balance.cost import sample_work
from gem_platform.balance.partition import balanced_partition, descending_order
from gem_platform.balance.rolling import DEFAULT_WINDOW_BATCHES, PackingBatcher
from gem_platform.balance.sequential import SequentialBatcher
from gem_platform.balance.stats import Summary, straggler_overhead, straggler_overheads
from gem_platform.errors import DataError, RecipeError

METHODS = ("none", "bbs", "bbs_v2", "global")


@dataclass(frozen=True)
class ProfileRow:
    """One method's figures over all steps of one epoch."""

    method: str
    padding_waste: float  # mean over the ranks' local batches
    straggler_mean: float  # straggler overhead, mean over steps
    straggler_p95: float
    straggler_max: float
    rank_work_mean: float  # work of one rank's local batch, mean over steps and ranks
    rank_work_max: float
    # (none - this) / (none - global) of the mean straggler overhead: 1 = the upper bound
    share_of_global_gain: float | None
    ms_per_full_batch: float  # batching CPU time (per rank-step; for global, per step / world)


@dataclass
class ProfileReport:
    """Rows for none / bbs / bbs_v2 / global, and the (steps, world) work matrices behind them."""

    world: int
    local_batch: int
    steps: int
    cfg: LoaderConfig
    rows: list[ProfileRow]
    work: dict[str, np.ndarray] = field(repr=False)  # method -> (steps, world)

    @property
    def local_bound(self) -> float:
        """The lowest mean straggler overhead any local-only balancer can reach with this
        buffer: a BBS buffer holds exactly the samples of the same steps under "none", and no
        reordering inside it can give every step less than the buffer's mean work."""
        buffer = self.cfg.buffer_full_batches
        none = self.work["none"]
        per_step = []
        for first in range(0, self.steps, buffer):
            window = none[first : first + buffer]
            per_step += [straggler_overhead(window.mean(axis=0))] * window.shape[0]
        return float(np.mean(per_step))

    def row(self, method: str) -> ProfileRow:
        return next(r for r in self.rows if r.method == method)

    def to_dict(self) -> dict:
        """JSON-ready summary (no per-rank matrices)."""
        return {
            "world": self.world,
            "local_batch": self.local_batch,
            "steps": self.steps,
            "loader": self.cfg.model_dump(),
            "local_bound": self.local_bound,
            "rows": [asdict(r) for r in self.rows],
        }

    def save_png(self, path: str | Path) -> Path:
        """Histogram of per-rank work (relative to the step mean) for each method, and the
        straggler overhead of every step."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig = Figure(figsize=(11, 4.2))
        FigureCanvasAgg(fig)
        hist_ax, step_ax = fig.subplots(1, 2)
        relative = {m: w / w.mean(axis=1, keepdims=True) for m, w in self.work.items()}
        lo = min(float(r.min()) for r in relative.values())
        hi = max(float(r.max()) for r in relative.values())
        bins = np.linspace(lo, hi, 60)
        for method in self.work:
            r = self.row(method)
            hist_ax.hist(relative[method].ravel(), bins=bins, alpha=0.55,
                         label=f"{method}: straggler {100 * r.straggler_mean:.2f}%")
            step_ax.plot(100 * straggler_overheads(self.work[method]), label=method)
        hist_ax.set_xlabel("rank work / mean rank work at that step")
        hist_ax.set_ylabel("rank-steps")
        hist_ax.set_title(f"Per-rank work, world {self.world}, local batch {self.local_batch}, "
                          f"cost '{self.cfg.cost}'", fontsize=9)
        hist_ax.legend(fontsize=8)
        step_ax.set_xlabel("step")
        step_ax.set_ylabel("straggler overhead (%)")
        step_ax.set_title("max / mean - 1 across ranks", fontsize=9)
        step_ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return path


def shard(lengths: np.ndarray, world: int, seed: int = 0) -> list[np.ndarray]:
    """Deal a global length array to ``world`` ranks the way a distributed sampler does
    (seeded permutation, then every world-th sample)."""
    perm = np.random.default_rng([seed, world]).permutation(lengths.size)
    return [lengths[perm[r::world]] for r in range(world)]


def check_profile_size(samples: int, world: int, local_batch: int) -> None:
    """Refuse (RecipeError) a profile whose one step needs more than ``samples`` samples."""
    if samples < world * local_batch:
        raise RecipeError(
            f"{samples:,} training samples can't give {world:,} ranks a local batch of "
            f"{local_batch:,} each: one step needs {world * local_batch:,}.",
            "Profile fewer ranks (--world), a smaller --local-batch, or a larger dataset.")


def profile_lengths(
    lengths: np.ndarray | Sequence[np.ndarray],
    world: int,
    local_batch: int,
    cfg: LoaderConfig,
    steps: int | None = None,
    epoch: int = 0,
    include_global: bool = True,
) -> ProfileReport:
    """Padding waste and straggler overhead of one epoch under none / bbs / bbs_v2 / global.

    ``lengths`` is either the global length array (sharded over ``world`` ranks like a
    distributed sampler) or one array per rank. ``steps`` defaults to the common step count
    (global minimum of samples per rank // local_batch). ``include_global=False`` skips the
    upper bound (its row is then absent and shares of its gain are None).
    """
    if isinstance(lengths, np.ndarray) and lengths.ndim == 1:
        check_profile_size(lengths.size, world, local_batch)  # before dealing: O(world) work
    per_rank = _per_rank(lengths, world, cfg.seed)
    try:
        base = LoaderConfig.model_validate({**cfg.model_dump(), "local_batch_size": local_batch})
    except ValidationError as err:
        raise RecipeError(f"Can't profile with local batch {local_batch}: "
                          f"{err.errors()[0]['msg']}") from err
    if steps is None:
        steps = common_steps_per_epoch([r.size for r in per_rank], local_batch)
    none_cfg = base.model_copy(update={"batching": "sequential", "shuffle": True})
    bbs_cfg = base.model_copy(update={"batching": "bbs", "window_samples": None})
    v2_cfg = base.model_copy(update={
        "batching": "bbs_v2",
        "window_samples": base.window_samples or DEFAULT_WINDOW_BATCHES * local_batch})
    expected = float(np.mean(np.concatenate(
        [sample_work(r, base.cost, base.model_dim) for r in per_rank])))

    methods = METHODS if include_global else METHODS[:3]
    work = {m: np.zeros((steps, world)) for m in methods}
    waste = {m: np.zeros((steps, world)) for m in methods}
    seconds = dict.fromkeys(methods, 0.0)
    step_samples: list[list[np.ndarray]] = [[] for _ in range(steps)]
    for rank, rank_lengths in enumerate(per_rank):
        w = sample_work(rank_lengths, base.cost, base.model_dim)
        for method, make in (
            ("none", lambda r=rank, x=rank_lengths: SequentialBatcher(none_cfg, x, steps, r)),
            ("bbs", lambda r=rank, x=rank_lengths: BBSBatcher(bbs_cfg, x, steps, r)),
            ("bbs_v2", lambda r=rank, x=rank_lengths: PackingBatcher(
                v2_cfg, x, steps, r, expected_work=expected)),
        ):
            t0 = time.process_time()  # CPU time: the batcher's cost, whatever shares the CPU
            batches = list(make().epoch(epoch))
            seconds[method] += time.process_time() - t0
            flat = np.concatenate(batches)
            starts = np.cumsum([0] + [b.size for b in batches[:-1]])
            picked = rank_lengths[flat].astype(np.float64)
            work[method][:, rank] = np.add.reduceat(w[flat], starts)
            longest = np.maximum.reduceat(picked, starts)
            sizes = np.diff(np.append(starts, flat.size))
            real = np.add.reduceat(picked, starts)
            waste[method][:, rank] = np.where(longest > 0, 1.0 - real / (sizes * longest), 0.0)
            if method == "none" and include_global:
                for s, idx in enumerate(batches):
                    step_samples[s].append(rank_lengths[idx])

    if include_global:
        seconds["global"] = _partition_globally(step_samples, base, world, work["global"],
                                                waste["global"])
    rows = _rows(methods, work, waste, seconds, steps * world)
    return ProfileReport(world=world, local_batch=local_batch, steps=steps, cfg=base,
                         rows=rows, work=work)


def _partition_globally(step_samples: list[list[np.ndarray]], cfg: LoaderConfig, world: int,
                        work: np.ndarray, waste: np.ndarray) -> float:
    """The upper bound: each step's samples of every rank partitioned over the ranks by work.
    Fills ``work`` and ``waste`` (steps x world); returns the CPU seconds it took."""
    seconds = 0.0
    for s, parts in enumerate(step_samples):
        step_lengths = np.concatenate(parts)
        t0 = time.process_time()
        w = sample_work(step_lengths, cfg.cost, cfg.model_dim)
        assign = balanced_partition(w, world, order=descending_order(step_lengths))
        seconds += time.process_time() - t0
        work[s] = np.bincount(assign, weights=w, minlength=world)
        waste[s] = _group_waste(step_lengths, assign, world)
    return seconds


def _rows(methods: Sequence[str], work: dict[str, np.ndarray], waste: dict[str, np.ndarray],
          seconds: dict[str, float], batches: int) -> list[ProfileRow]:
    """One row per method; shares of the gain are taken against "global" when it ran."""
    straggler = {m: straggler_overheads(work[m]) for m in methods}
    none_mean = float(straggler["none"].mean())
    gap = none_mean - float(straggler["global"].mean()) if "global" in straggler else 0.0
    rows = []
    for m in methods:
        s = Summary.of(straggler[m])
        rows.append(ProfileRow(
            method=m,
            padding_waste=float(waste[m].mean()),
            straggler_mean=s.mean,
            straggler_p95=s.p95,
            straggler_max=s.max,
            rank_work_mean=float(work[m].mean()),
            rank_work_max=float(work[m].max()),
            share_of_global_gain=(none_mean - s.mean) / gap if gap > 0 else None,
            ms_per_full_batch=1e3 * seconds[m] / batches,
        ))
    return rows


def _per_rank(lengths: np.ndarray | Sequence[np.ndarray], world: int,
              seed: int) -> list[np.ndarray]:
    if world < 1:
        raise RecipeError(f"world must be at least 1, got {world}.", "Pass --world N with N >= 1.")
    if isinstance(lengths, np.ndarray) and lengths.ndim == 1:
        return shard(lengths, world, seed)
    per_rank = [np.asarray(r) for r in lengths]
    if len(per_rank) != world:
        raise DataError(f"Got lengths for {len(per_rank)} ranks but world = {world}.",
                        "Pass one length array per rank, or one global array.")
    return per_rank


def _group_waste(lengths: np.ndarray, assign: np.ndarray, parts: int) -> np.ndarray:
    """Padding waste of each part of a partition."""
    order = np.argsort(assign.astype(np.int16 if parts < 2**15 else np.int64), kind="stable")
    counts = np.bincount(assign, minlength=parts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    longest = np.maximum.reduceat(lengths[order].astype(np.float64), starts)
    sums = np.bincount(assign, weights=lengths.astype(np.float64), minlength=parts)
    real = np.where(counts > 0, counts * longest, 1.0)
    return np.where((counts > 0) & (longest > 0), 1.0 - sums / real, 0.0)
