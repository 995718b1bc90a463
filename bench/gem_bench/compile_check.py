"""Does compiling change what the model computes? Step 1 of a recipe trained compiled and
eager, in one fresh process, both deterministic and unclipped (``step1.step1_gradients``),
and every parameter's gradient compared: relative L2 error ``|compiled - eager| / |eager|``.

Compiled regions must compute the eager model's gradients up to rounding. A generated kernel
that reads memory before another thread wrote it gives gradients that are off by much more
than rounding and change from run to run: the DHEN layers' compiled input gradient was once far
off on the H200 (docs/bench/determinism_h200_dhen_race.json) and nothing else noticed.

The compiled run compiles as training does: through Inductor unless
``train.compile_backend`` says otherwise. The tolerance defaults to what the recipe's
precision allows between two summation orders: 1e-3 in fp32, 3e-2 under bf16 autocast or
FP8 (tighter checks: ``--set precision.mode=fp32``). A table of the worst parameters on
stdout, ``compile_check.json`` under ``--out``; exit 1 when a gradient is beyond the
tolerance.

    gemctl bench compile-check recipes/h200.yaml --set data.synthetic.num_samples=100000
    (or: PYTHONPATH=kernels:platform:bench:. python -m gem_bench.compile_check ...)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from gem_platform.fresh_process import call_in_fresh_process

TOLERANCE = {"fp32": 1e-3, "bf16": 3e-2, "fp8_block": 3e-2}
SHOWN = 10


def relative_errors(compiled: dict[str, Any], eager: dict[str, Any]) -> list[dict[str, Any]]:
    """Per parameter of ``eager``: the relative L2 error of the compiled gradient (inf when
    the compiled run has none or another shape), the worst first."""
    rows = []
    for name, ref in eager.items():
        got = compiled.get(name)
        scale = float(ref.double().norm())
        if got is None or got.shape != ref.shape:
            error = math.inf
        else:
            diff = float((got.double() - ref.double()).norm())
            error = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        rows.append({"parameter": name, "relative_error": error, "eager_norm": scale})
    return sorted(rows, key=lambda r: -r["relative_error"])


def beyond_tolerance(rows: list[dict[str, Any]], limit: float) -> list[str]:
    """The parameters whose relative error exceeds ``limit`` (NaN counts as beyond)."""
    return [r["parameter"] for r in rows if not r["relative_error"] <= limit]


def _both_runs(path: str, overrides: list[str]) -> dict[str, Any]:
    """Step 1 compiled, then eager, in this (fresh) process; their gradients compared and the
    recipe's precision."""
    from gem_bench.step1 import step1_gradients
    from gem_platform.recipe import load_recipe

    compiled = step1_gradients(path, [*overrides, "train.compile=true"])
    eager = step1_gradients(path, [*overrides, "train.compile=false"])
    precision = load_recipe(path, overrides).precision.mode
    return {"precision": precision, "rows": relative_errors(compiled, eager)}


def check(path: str, overrides: list[str], tolerance: float | None = None) -> dict[str, Any]:
    """The comparison for one recipe, trained in a fresh process; ``ok`` when every gradient
    is within ``tolerance`` (default: by the recipe's precision, ``TOLERANCE``)."""
    result = call_in_fresh_process(_both_runs, path, overrides)
    limit = TOLERANCE[result["precision"]] if tolerance is None else tolerance
    beyond = beyond_tolerance(result["rows"], limit)
    return {"recipe": path, "overrides": overrides, "precision": result["precision"],
            "tolerance": limit, "ok": not beyond, "beyond_tolerance": beyond,
            "worst": result["rows"][:SHOWN], "parameters": len(result["rows"])}


def _print(report: dict[str, Any]) -> None:
    print(f"{report['recipe']} ({report['precision']}): compiled vs eager step-1 gradients, "
          f"{report['parameters']} parameters, tolerance {report['tolerance']:g}")
    for row in report["worst"]:
        flag = "BEYOND" if row["parameter"] in report["beyond_tolerance"] else "ok"
        print(f"  {row['parameter']:48s} {row['relative_error']:10.3e}  "
              f"(|eager| {row['eager_norm']:.3e})  {flag}")
    verdict = ("every gradient within tolerance" if report["ok"] else
               f"{len(report['beyond_tolerance'])} gradient(s) beyond tolerance")
    print(f"  -> {verdict}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipes", nargs="+", help="recipe YAML files")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="override applied to every recipe and both runs, e.g. "
                   "precision.mode=fp32")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest relative L2 error allowed (default: by precision, "
                   f"{TOLERANCE})")
    p.add_argument("--out", default="bench_results", help="folder for compile_check.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for path in args.recipes:
        reports.append(check(path, args.overrides, args.tolerance))
        _print(reports[-1])
        (out / "compile_check.json").write_text(json.dumps({"recipes": reports}, indent=1))
    print(f"-> {out / 'compile_check.json'}")
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
