"""What train.deterministic costs and whether it holds: each recipe trained once plain and twice
with ``train.deterministic`` on, every run in a fresh process (cuBLAS reads its workspace
setting once per process), in-process training without Ray or MLflow.

Per recipe it reports samples/s (perf/qps, steady steps) plain and deterministic, the cost
(1 - deterministic / plain), and whether the two deterministic runs agree bitwise on every step
loss and every final metric that does not measure time. Those runs print progress lines (each
drains the device queue) and time few steps, so their samples/s say what a run of that length
gets, not the cost to within a few percent: on the H200 two identical deterministic runs of
recipes/h200.yaml differed in speed by more than the cost (docs/bench). For the cost itself,
``gemctl bench e2e RECIPE --arms ours,ours_deterministic --repeats N`` times a fixed window
of steps without progress lines, N runs of each arm, and compares their medians (on a
host-bound recipe one process's speed can differ from the next one's by more than the cost).
``--grads`` also trains one unclipped deterministic step in two more processes and names the
parameters whose gradients differ, the one nearest the loss first: where to look when runs are
not repeatable (``--grads-only`` runs just that, a quick predicate for bisecting).
``--grads-in-one-process`` trains that step twice in ONE fresh process instead, the second time
through the compiled graphs and tuned kernels the first one made: gradients that still differ
vary at run time (atomics, memory read before it is written), not with how a process compiled
them. A table on stdout, and ``repro_bench.json`` under ``--out`` (rewritten after each run, so
a cut-short run keeps what it finished).

    gemctl bench repro recipes/h200.yaml recipes/h200_gem.yaml --out bench_results
    (or: PYTHONPATH=kernels:platform:bench:. python -m gem_bench.repro ...)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

from gem_platform.fresh_process import call_in_fresh_process

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


def _step1_gradients(path: str, overrides: list[str]) -> dict[str, str]:
    """A digest of each parameter's step-1 gradient (``step1.step1_gradients``), trained in
    this (fresh) process."""
    from gem_bench.step1 import step1_gradients

    return {name: _digest(grad) for name, grad in step1_gradients(path, overrides).items()}


def _digest(tensor: Any) -> str:
    """SHA-1 of a tensor's bytes as stored."""
    import torch

    raw = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.sha1(raw.tobytes()).hexdigest()


def first_differing(a: dict[str, str], b: dict[str, str]) -> dict[str, Any]:
    """Which gradients differ between two runs; the first in backward order (the module
    nearest the loss, taken as the last registered) is where to look."""
    differ = [n for n in a if a[n] != b.get(n)]
    nearest = next((n for n in reversed(list(a)) if a[n] != b.get(n)), None)
    return {"parameters": len(a), "differing": len(differ), "nearest_the_loss": nearest,
            "differing_names": differ}


def _untimed(value: Any) -> Any:
    """A summary entry without its wall times: the learning curve's points keep everything
    but their training seconds."""
    if isinstance(value, list):
        return [{k: v for k, v in p.items() if k != "train_s"} if isinstance(p, dict) else p
                for p in value]
    return value


def _agree(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, list[str]]:
    """Bitwise agreement of two runs: step losses and non-timing summary entries; the
    entries that differ."""
    differ = [] if a["losses"] == b["losses"] else ["train/loss (per step)"]
    keys = sorted(k for k in set(a["summary"]) | set(b["summary"]) if not _timing(k))
    differ += [k for k in keys
               if _untimed(a["summary"].get(k)) != _untimed(b["summary"].get(k))]
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


def _step1_gradients_twice(path: str, overrides: list[str]) -> list[dict[str, str]]:
    """``_step1_gradients`` twice in this process (the second reuses what the first compiled)."""
    return [_step1_gradients(path, overrides) for _ in range(2)]


def _compare_gradients(path: str, overrides: list[str], one_process: bool = False
                       ) -> dict[str, Any]:
    """Step-1 gradient digests from two fresh processes (or twice from one), compared."""
    if one_process:
        digests = call_in_fresh_process(_step1_gradients_twice, path, overrides)
        return {**first_differing(*digests), "in_one_process": True}
    return first_differing(*(call_in_fresh_process(_step1_gradients, path, overrides)
                             for _ in range(2)))


def _device() -> dict[str, Any]:
    from gem_platform.provenance import environment

    return environment()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipes", nargs="+", help="recipe YAML files")
    p.add_argument("--out", default="bench_results", help="folder for repro_bench.json")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="override applied to every recipe, e.g. train.steps=100")
    p.add_argument("--grads", action="store_true",
                   help="also train one deterministic step, unclipped, in two more processes "
                   "and name the parameters whose gradients differ")
    p.add_argument("--grads-only", action="store_true",
                   help="only that gradient check, not the three timed runs (a quick "
                   "predicate: exit 0 when the gradients agree)")
    p.add_argument("--grads-in-one-process", action="store_true",
                   help="with --grads or --grads-only: train that step twice in one process "
                   "(differences then come from run time, not from compilation)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"overrides": args.overrides, "recipes": {},
                              "device": call_in_fresh_process(_device)}
    for path in args.recipes:
        if not args.grads_only:
            _timed_runs(path, args.overrides, report, out)
        if args.grads or args.grads_only:
            v = report["recipes"].setdefault(path, {})
            v["step1_gradients"] = _compare_gradients(path, args.overrides,
                                                      args.grads_in_one_process)
            print(f"{path:32s} step-1 gradients: {v['step1_gradients']}", flush=True)
            (out / "repro_bench.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"-> {out / 'repro_bench.json'}")
    return 0 if all(_repeatable(v) for v in report["recipes"].values()) else 1


def _repeatable(verdict: dict[str, Any]) -> bool:
    """Every check that ran agreed: the two deterministic runs, the step-1 gradients."""
    grads = verdict.get("step1_gradients")
    return verdict.get("bitwise_identical", True) and (grads is None or grads["differing"] == 0)


def _timed_runs(path: str, overrides: list[str], report: dict[str, Any], out: Path) -> None:
    """The plain run and the two deterministic ones of one recipe, each in a fresh process;
    the report is rewritten after each."""
    runs: dict[str, dict[str, Any]] = {}
    for name, deterministic in RUNS:
        # A fresh process per run: the cuBLAS workspace and every switch start clean.
        runs[name] = call_in_fresh_process(_one_run, path, overrides, deterministic)
        report["recipes"][path] = {"runs": runs, **_verdict(runs)}
        (out / "repro_bench.json").write_text(json.dumps(report, indent=1, default=str))
        s = runs[name]["summary"]
        print(f"{path:32s} {name:20s} qps {s['perf/qps']:10.1f}  "
              f"NE ctr {s.get('eval/ne_ctr', math.nan):.6f}  wall {runs[name]['wall_s']:.0f}s",
              flush=True)
    v = report["recipes"][path]
    print(f"{path:32s} cost {v['cost']:.1%}  bitwise identical: {v['bitwise_identical']}"
          + (f" (differ: {', '.join(v['differing'])})" if v["differing"] else ""), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
