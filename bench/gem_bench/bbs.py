"""Simulation benchmark of batch balancing (CPU): straggler overhead with no balancing, with
BBS, with BBS v2 and with a global balanced partition, at simulated world sizes, plus the
batchers' cost.

    python -m gem_bench.bbs --out bench_results/bbs        # worlds 8..4096
    python -m gem_bench.bbs --quick --out /tmp/bbs         # worlds 8, 64
    python -m gem_bench.bbs --out docs/bench               # the committed figures
    (or gemctl bench bbs; PYTHONPATH=kernels:platform:bench where not installed)

Every rank holds ``steps * local_batch`` samples (1024 samples per rank per step) drawn from
one of two length distributions: ``lognormal`` (median 128, sigma 1, clipped to 16..2048) and
``demo`` (recipes/demo.yaml's synthetic histories: log-normal with mean 40, sigma 0.8,
clipped to 16..128). BBS buffers span the epoch; BBS v2 packs from a window of 8 local
batches to the dataset's mean work per batch. A rank's step time is taken as proportional to
its batch work under the cost model. The run prints the tables and writes ``bbs.json`` into
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as _platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gem_platform.balance.config import CostName, LoaderConfig
from gem_platform.balance.profile import profile_lengths

MEDIAN_LENGTH = 128
SIGMA = 1.0
MIN_LENGTH, MAX_LENGTH = 16, 2048
# name -> (median, sigma, min, max); demo = recipes/demo.yaml's seq_len (mean 40, sigma 0.8)
DISTRIBUTIONS: dict[str, tuple[float, float, int, int]] = {
    "lognormal": (MEDIAN_LENGTH, SIGMA, MIN_LENGTH, MAX_LENGTH),
    "demo": (40.0 * float(np.exp(-0.8**2 / 2)), 0.8, 16, 128),
}


def long_tailed_lengths(n: int, rng: np.random.Generator, dist: str = "lognormal"
                        ) -> np.ndarray:
    """Log-normal sequence lengths of ``dist`` (see DISTRIBUTIONS), clipped, as int16 (to keep
    big worlds small)."""
    median, sigma, lo, hi = DISTRIBUTIONS[dist]
    raw = rng.lognormal(np.log(median), sigma, n)
    return np.clip(np.rint(raw), lo, hi).astype(np.int16)


@dataclass(frozen=True)
class SimRow:
    """One simulated world size under one cost model."""

    world: int
    lengths: str
    cost: str
    buffer_full_batches: int
    steps: int
    none: float  # straggler overhead, mean over steps
    bbs: float
    local_bound: float  # best any local-only balancer can do with this buffer
    global_: float | None
    none_p95: float
    bbs_p95: float
    share_of_global_gain: float | None  # (none - bbs) / (none - global)
    padding_waste: float  # of the padded layout, no balancing
    bbs_ms_per_full_batch: float
    seconds: float
    bbs_v2: float | None = None
    bbs_v2_p95: float | None = None
    bbs_v2_share_of_global_gain: float | None = None
    bbs_v2_ms_per_full_batch: float | None = None


def rank_lengths(world: int, samples: int, seed: int, dist: str = "lognormal"
                 ) -> list[np.ndarray]:
    """Fresh long-tailed lengths for every rank, deterministic in (seed, world, samples)."""
    rng = np.random.default_rng([seed, world, samples])
    return [long_tailed_lengths(samples, rng, dist) for _ in range(world)]


def sim_row(per_rank: list[np.ndarray], steps: int, cfg: LoaderConfig,
            include_global: bool = True, dist: str = "lognormal") -> SimRow:
    """Profile one epoch of ``steps`` steps over ``per_rank`` and keep the headline figures."""
    t0 = time.perf_counter()
    world = len(per_rank)
    report = profile_lengths(per_rank, world, cfg.local_batch_size, cfg, steps=steps,
                             include_global=include_global)
    none, bbs, v2 = report.row("none"), report.row("bbs"), report.row("bbs_v2")
    glob = report.row("global") if include_global else None
    share, v2_share = bbs.share_of_global_gain, v2.share_of_global_gain
    if glob is None and none.straggler_mean > 0:
        # the global partition reaches ~0, so this is a lower bound on the share
        share = 1.0 - bbs.straggler_mean / none.straggler_mean
        v2_share = 1.0 - v2.straggler_mean / none.straggler_mean
    return SimRow(world=world, lengths=dist, cost=cfg.cost,
                  buffer_full_batches=cfg.buffer_full_batches,
                  steps=steps, none=none.straggler_mean, bbs=bbs.straggler_mean,
                  local_bound=report.local_bound,
                  global_=glob.straggler_mean if glob else None,
                  none_p95=none.straggler_p95, bbs_p95=bbs.straggler_p95,
                  share_of_global_gain=share, padding_waste=none.padding_waste,
                  bbs_ms_per_full_batch=bbs.ms_per_full_batch,
                  seconds=time.perf_counter() - t0,
                  bbs_v2=v2.straggler_mean, bbs_v2_p95=v2.straggler_p95,
                  bbs_v2_share_of_global_gain=v2_share,
                  bbs_v2_ms_per_full_batch=v2.ms_per_full_batch)


def batcher_cost(cfg: LoaderConfig, steps: int, reps: int, seed: int) -> dict[str, float]:
    """Median CPU ms per full batch of building and iterating one rank's epoch, per batching
    (CPU time: the batcher runs on one thread, so on an idle core this is its wall time too;
    on a shared machine wall time also counts other processes' turns)."""
    from gem_platform.balance import make_batcher

    lengths = long_tailed_lengths(steps * cfg.local_batch_size, np.random.default_rng(seed))
    out: dict[str, float] = {}
    for batching in ("sequential", "bbs", "bbs_v2"):
        window = 8 * cfg.local_batch_size if batching == "bbs_v2" else None
        c = cfg.model_copy(update={"batching": batching, "window_samples": window})
        times = []
        for rep in range(reps):  # a fresh plan per rep: another seed, epoch 0 (a rolling
            # batcher asked for a later epoch first would replay the ones before it)
            t0 = time.process_time()
            for _ in make_batcher(c.model_copy(update={"seed": seed + rep}), lengths).epoch(0):
                pass
            times.append(time.process_time() - t0)
        out[f"{batching}_ms_per_full_batch"] = 1e3 * float(np.median(times)) / steps
    out["samples_per_rank"] = float(lengths.size)
    out["buffer_full_batches"] = float(cfg.buffer_full_batches)
    return out


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def print_table(rows: Sequence[SimRow], title: str) -> None:
    cols = ["world", "lengths", "cost", "steps", "none", "bbs", "bbs_v2", "global_",
            "local_bound", "share_of_global_gain", "bbs_v2_share_of_global_gain",
            "padding_waste", "bbs_ms_per_full_batch", "bbs_v2_ms_per_full_batch", "seconds"]
    data = [[_fmt(getattr(r, c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(d[i]) for d in data)) for i, c in enumerate(cols)]
    print(f"\n{title}", flush=True)
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for d in data:
        print("  ".join(x.ljust(w) for x, w in zip(d, widths, strict=True)), flush=True)


def v2_targets(rows: Sequence[SimRow], cost_ms: dict[str, float]) -> dict[str, dict]:
    """BBS v2's targets: >= 80% of the global partition's gain at every simulated world and
    length distribution, under 1 ms per full batch."""
    shares = {f"{r.lengths}/{r.cost}/world {r.world}": r.bbs_v2_share_of_global_gain
              for r in rows}
    return {
        "bbs_v2_reaches_80pct_of_global_gain_everywhere": {
            "shares": shares,
            "met": all((v or 0.0) >= 0.8 for v in shares.values()),
        },
        "bbs_v2_under_1ms_per_full_batch": {
            "bbs_v2_ms": cost_ms["bbs_v2_ms_per_full_batch"],
            "met": cost_ms["bbs_v2_ms_per_full_batch"] < 1.0,
        },
    }


def targets(rows: Sequence[SimRow], cost_ms: dict[str, float],
            sweep: Sequence[SimRow] = ()) -> dict[str, dict]:
    """The three targets, checked at the largest world under the length cost model, plus how
    close BBS is to the best local-only balancing and which buffer reaches 90% of the gain."""
    top = max((r for r in rows if r.cost == "length" and r.lengths == "lognormal"),
              key=lambda r: r.world)
    local_gap = top.none - top.local_bound
    enough = [r.buffer_full_batches for r in sweep if (r.share_of_global_gain or 0.0) >= 0.9]
    return {
        "straggler_bbs_le_3pct_where_none_about_15pct": {
            "world": top.world, "none": top.none, "bbs": top.bbs,
            "met": top.bbs <= 0.03 and 0.10 <= top.none <= 0.20,
        },
        "bbs_reaches_90pct_of_global_gain": {
            "world": top.world, "buffer_full_batches": top.buffer_full_batches,
            "share": top.share_of_global_gain,
            "met": (top.share_of_global_gain or 0.0) >= 0.9,
            "share_of_local_only_bound_gain": ((top.none - top.bbs) / local_gap
                                               if local_gap > 0 else None),
            "smallest_sweep_buffer_reaching_90pct": min(enough) if enough else None,
        },
        "batcher_under_1ms_per_full_batch": {
            "bbs_ms": cost_ms["bbs_ms_per_full_batch"],
            "met": cost_ms["bbs_ms_per_full_batch"] < 1.0,
        },
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_results/bbs"))
    parser.add_argument("--quick", action="store_true", help="worlds 8 and 64, short epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per epoch = BBS buffer (default 128, --quick 16)")
    args = parser.parse_args(argv)

    worlds = [8, 64] if args.quick else [8, 64, 512, 4096]
    steps = args.steps or (16 if args.quick else 32)
    sweep_world, sweep_steps = (64, 64) if args.quick else (64, 128)
    sweep_buffers = [4, 16, 64] if args.quick else [8, 16, 32, 64, 128]
    costs: tuple[CostName, ...] = ("length", "attention")
    base = LoaderConfig(local_batch_size=1024, base_batch_size=128,
                        buffer_full_batches=steps, seed=args.seed)

    rows = []
    for dist in DISTRIBUTIONS:
        for w in worlds:
            data = rank_lengths(w, steps * base.local_batch_size, args.seed, dist)
            rows += [sim_row(data, steps, base.model_copy(update={"cost": c}), dist=dist)
                     for c in costs]
            del data
    print_table(rows, f"Straggler overhead (mean over {steps} steps), local batch 1024, "
                      f"BBS buffer {steps} full batches, BBS v2 window 8 local batches")
    data = rank_lengths(sweep_world, sweep_steps * base.local_batch_size, args.seed)
    sweep = [sim_row(data, sweep_steps, base.model_copy(update={"buffer_full_batches": f}),
                     include_global=False) for f in sweep_buffers]
    del data
    print_table(sweep, f"BBS buffer sweep at world {sweep_world}, {sweep_steps} steps, same "
                       "data (length cost; share taken against a global partition at 0)")
    # the batchers' own cost under the default buffer, over an epoch that fills it
    default = LoaderConfig(local_batch_size=1024, base_batch_size=128, seed=args.seed)
    cost_steps = steps if args.quick else default.buffer_full_batches
    cost_ms = batcher_cost(default, cost_steps, reps=5, seed=args.seed)
    print(f"\nBatcher cost on one rank ({int(cost_ms['samples_per_rank'])} samples, buffer "
          f"{int(cost_ms['buffer_full_batches'])}): "
          f"sequential {cost_ms['sequential_ms_per_full_batch']:.4f} ms, "
          f"bbs {cost_ms['bbs_ms_per_full_batch']:.4f} ms, "
          f"bbs_v2 {cost_ms['bbs_v2_ms_per_full_batch']:.4f} ms per full batch")
    checks = {**targets(rows, cost_ms, sweep), **v2_targets(rows, cost_ms)}
    for name, check in checks.items():
        print(f"target {name}: {'met' if check['met'] else 'NOT met'} {check}")

    payload = {
        "meta": {
            "lengths": {name: f"log-normal median {m:.1f}, sigma {sg}, clipped {lo}..{hi}"
                        for name, (m, sg, lo, hi) in DISTRIBUTIONS.items()},
            "bbs_v2_window": "8 local batches",
            "command": "gemctl bench bbs --out docs/bench",
            "local_batch": 1024, "base_batch": 128, "steps": steps, "quick": args.quick,
            "seed": args.seed, "python": _platform.python_version(),
            "batcher_cost": "CPU time (time.process_time) per full batch",
            "load_average_at_end": os.getloadavg(),
            "numpy": np.__version__, "cpus": os.cpu_count(),
        },
        "rows": [asdict(r) for r in rows],
        "buffer_sweep": [asdict(r) for r in sweep],
        "batcher_cost": cost_ms,
        "targets": checks,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bbs.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
