"""Loader benchmark (CPU): reader + collate throughput, time to first batch and peak memory of
the streaming reader against the in-memory table, on synthetic datasets with the H200
recipe's history lengths (log-normal, mean 400, 16..2048) at two sizes, the larger at least
10x the streaming window.

    python -m gem_bench.loader --out docs/bench      # the committed figures
    python -m gem_bench.loader --quick --out /tmp/ld  # small datasets
    (or gemctl bench loader; PYTHONPATH=kernels:platform:bench where not installed)

Each measurement runs in a fresh process (so peak RSS is that reader's alone): it opens the
table, builds the batcher (BBS v2) and iterates ``--steps`` batches of reader + collate, no
model. The streaming reader reads and validates in a background thread. Prints a table and
writes ``loader.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as _platform
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

LOCAL_BATCH = 1024
WINDOW = 8 * LOCAL_BATCH
SEQ_LEN = {"dist": "lognormal", "mean": 400, "sigma": 1.0, "min": 16, "max": 2048}


def _rss_mb() -> float:
    """Peak resident set size of this process so far (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def generate(path: Path, samples: int) -> dict:
    """The benchmark dataset of ``samples`` samples at ``path`` (reused when current)."""
    from gem_platform.data.config import DataConfig
    from gem_platform.data.prepare import prepare_dataset

    cfg = DataConfig(source="synthetic", path=str(path), synthetic={
        "num_samples": samples, "eval_fraction": 0.01, "num_users": 20_000,
        "num_items": 50_000, "seq_len": SEQ_LEN, "rows_per_shard": 4096})
    t0 = time.perf_counter()
    meta = prepare_dataset(cfg)
    size = sum(f.stat().st_size for f in path.glob("train-*.parquet"))
    return {"path": str(path), "train_samples": meta.num_train, "parquet_mb": size / 2**20,
            "generate_s": time.perf_counter() - t0}


def measure(path: str, mode: str, steps: int, window: int) -> dict:
    """One reader in this process: time to first batch, samples/s, peak RSS."""
    import numpy as np

    from gem_platform.balance import LoaderConfig, make_batcher
    from gem_platform.data.loader import expected_work, iterate, open_table

    base_rss = _current_rss_mb()
    cfg = LoaderConfig(batching="bbs_v2", local_batch_size=LOCAL_BATCH, cost="attention",
                       window_samples=window if mode == "stream" else None)
    t0 = time.perf_counter()
    table = open_table(path, "train", 0, 1, cfg)
    batcher = make_batcher(cfg, table.seq_lengths, pieces=table.pieces,
                           expected_work=expected_work(table.meta, cfg))
    batches = iterate(table, batcher, 0)
    batch, _ = next(batches)
    first = time.perf_counter() - t0
    samples, events, held = 0, 0, []
    t1, cpu1 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        batch, _ = next(batches)
        samples += batch.num_samples
        events += int(batch.seq_item_ids.numel())
        held.append(getattr(table, "rows_held", len(table)))
    seconds, cpu = time.perf_counter() - t1, time.process_time() - cpu1
    batches.close()
    return {
        "mode": mode, "window_samples": window if mode == "stream" else None,
        "train_samples": len(table), "steps": steps,
        "time_to_first_batch_s": first,
        "samples_per_s": samples / seconds, "events_per_s": events / seconds,
        # CPU seconds (all threads: reading, validation, collate) per 1000 samples: what the
        # reader costs, whatever else shares the machine
        "cpu_s_per_1k_samples": 1e3 * cpu / samples,
        "rows_held_max": int(np.max(held)),
        "rss_before_reading_mb": base_rss, "peak_rss_mb": _rss_mb(),
    }


def _run_measure(path: str, mode: str, steps: int, window: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "gem_bench.loader", "--measure", path, "--mode", mode,
         "--steps", str(steps), "--window", str(window)],
        capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"measuring {mode} on {path} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_table(rows: Sequence[dict]) -> None:
    cols = ["mode", "train_samples", "window_samples", "time_to_first_batch_s",
            "samples_per_s", "cpu_s_per_1k_samples", "rows_held_max", "peak_rss_mb"]
    text = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
            for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in text)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for t in text:
        print("  ".join(x.ljust(w) for x, w in zip(t, widths, strict=True)), flush=True)


def main(argv: Sequence[str] | None = None) -> dict | int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_results/loader"))
    parser.add_argument("--quick", action="store_true", help="small datasets, few steps")
    parser.add_argument("--data-dir", type=Path, default=Path("gem_data/bench_loader"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="stream", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.mode, args.steps or 30, args.window)))
        return 0

    sizes = [args.window, 3 * args.window] if args.quick else \
        [5 * args.window, 12 * args.window]
    steps = args.steps or (5 if args.quick else 40)
    datasets, rows = [], []
    for n in sizes:
        info = generate(args.data_dir / f"n{n}", int(n / 0.99) + 1)
        datasets.append(info)
        for mode in ("stream", "memory"):
            rows.append({**_run_measure(info["path"], mode, steps, args.window),
                         "parquet_mb": info["parquet_mb"]})
    print(f"\nReader + collate, one process, local batch {LOCAL_BATCH}, BBS v2, histories "
          f"log-normal mean {SEQ_LEN['mean']} in {SEQ_LEN['min']}..{SEQ_LEN['max']}")
    print_table(rows)
    stream = [r for r in rows if r["mode"] == "stream"]
    small, large = stream[0], stream[-1]
    growth = large["peak_rss_mb"] - small["peak_rss_mb"]
    data_growth = datasets[-1]["parquet_mb"] - datasets[0]["parquet_mb"]
    targets = {
        "largest_dataset_at_least_10x_window": {
            "ratio": large["train_samples"] / args.window,
            "met": large["train_samples"] >= 10 * args.window},
        "stream_rss_bounded_by_window": {
            "peak_rss_growth_mb": growth, "parquet_growth_mb": data_growth,
            "rows_held_max": max(r["rows_held_max"] for r in stream),
            "met": growth < 0.25 * max(data_growth, 1e-9)},
        "stream_faster_than_h200_training_10700_samples_per_s": {
            "samples_per_s": min(r["samples_per_s"] for r in stream),
            "met": min(r["samples_per_s"] for r in stream) > 10_700},
    }
    for name, check in targets.items():
        print(f"target {name}: {'met' if check['met'] else 'NOT met'} {check}")
    payload = {
        "meta": {"command": "gemctl bench loader --out docs/bench", "quick": args.quick,
                 "local_batch": LOCAL_BATCH, "window_samples": args.window,
                 "seq_len": SEQ_LEN, "steps": steps, "python": _platform.python_version(),
                 "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "datasets": datasets, "rows": rows, "targets": targets,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "loader.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
