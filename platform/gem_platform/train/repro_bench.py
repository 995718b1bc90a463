"""What train.deterministic costs and whether it holds: each recipe trained once plain and twice
with ``train.deterministic`` on, every run in a fresh process (cuBLAS reads its workspace
setting once per process), in-process training without Ray or MLflow.

Per recipe it reports samples/s (perf/qps, steady steps) plain and deterministic, the cost
(1 - deterministic / plain), and whether the two deterministic runs agree bitwise on every step
loss and every final metric that does not measure time. A table on stdout, and
``repro_bench.json`` under ``--out`` (rewritten after each run, so a cut-short run keeps what
it finished).

    PYTHONPATH=kernels:platform:. python -m gem_platform.train.repro_bench \\
        recipes/h200.yaml recipes/h200_gem.yaml --out bench_results
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

RUNS = (("plain", False), ("deterministic", True), ("deterministic_rerun", True))


def _timing(key: str) -> bool:
    """Summary entries that measure time (or name the peak MFU is taken against)."""
    return (key.startswith("perf/") and key != "perf/train_flops_per_step") \
        or key == "peak_source"


def _one_run(path: str, overrides: list[str], deterministic: bool) -> dict[str, Any]:
    """Train the recipe once in this (fresh) process; its step losses and summary."""
    from gem_platform.recipe import load_recipe
    from gem_platform.train.loop import train

    recipe = load_recipe(path, [*overrides, f"train.deterministic={str(deterministic).lower()}"])
    losses: list[float] = []

    def sink(metrics: dict[str, float], step: int) -> None:
        if "train/loss" in metrics:
            losses.append(metrics["train/loss"])

    t0 = time.perf_counter()
    summary = train(recipe, sink=sink, echo=lambda _: None)
    return {"deterministic": deterministic, "wall_s": time.perf_counter() - t0,
            "losses": losses, "summary": summary}


def _agree(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, list[str]]:
    """Bitwise agreement of two runs: step losses and non-timing summary entries; the
    entries that differ."""
    differ = [] if a["losses"] == b["losses"] else ["train/loss (per step)"]
    keys = sorted(k for k in set(a["summary"]) | set(b["summary"]) if not _timing(k))
    differ += [k for k in keys if a["summary"].get(k) != b["summary"].get(k)]
    return not differ, differ


def _verdict(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if {"deterministic", "deterministic_rerun"} <= runs.keys():
        ok, differ = _agree(runs["deterministic"], runs["deterministic_rerun"])
        out.update(bitwise_identical=ok, differing=differ)
    if "plain" in runs and "deterministic" in runs:
        plain = runs["plain"]["summary"]["perf/qps"]
        det = [runs[n]["summary"]["perf/qps"] for n in ("deterministic", "deterministic_rerun")
               if n in runs]
        out.update(qps_plain=plain, qps_deterministic=sum(det) / len(det),
                   cost=1 - (sum(det) / len(det)) / plain if plain else math.nan)
    return out


def _device() -> dict[str, Any]:
    from gem_kernels.bench.common import device_info

    return device_info()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipes", nargs="+", help="recipe YAML files")
    p.add_argument("--out", default="bench_results", help="folder for repro_bench.json")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="override applied to every recipe, e.g. train.steps=100")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spawn = multiprocessing.get_context("spawn")
    report: dict[str, Any] = {"overrides": args.overrides, "recipes": {}}
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        report["device"] = pool.submit(_device).result()
    for path in args.recipes:
        runs: dict[str, dict[str, Any]] = {}
        for name, deterministic in RUNS:
            # A fresh process per run: the cuBLAS workspace and every switch start clean.
            with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                runs[name] = pool.submit(_one_run, path, args.overrides, deterministic).result()
            report["recipes"][path] = {"runs": runs, **_verdict(runs)}
            (out / "repro_bench.json").write_text(json.dumps(report, indent=1, default=str))
            s = runs[name]["summary"]
            print(f"{path:32s} {name:20s} qps {s['perf/qps']:10.1f}  "
                  f"NE ctr {s.get('eval/ne_ctr', math.nan):.6f}  wall {runs[name]['wall_s']:.0f}s",
                  flush=True)
        v = report["recipes"][path]
        print(f"{path:32s} cost {v['cost']:.1%}  bitwise identical: {v['bitwise_identical']}"
              + (f" (differ: {', '.join(v['differing'])})" if v["differing"] else ""), flush=True)
    print(f"-> {out / 'repro_bench.json'}")
    return 0 if all(v.get("bitwise_identical") for v in report["recipes"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
