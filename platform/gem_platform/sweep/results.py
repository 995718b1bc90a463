"""Trial results as plain records, and their JSON file form.

A sweep's trials normally live in MLflow (one child run each). A sweep run in-process, on a
machine without Ray or an MLflow server (a lone GPU box), writes the same records to a JSON
file instead; ``gemctl compare`` reads that file like a sweep id, so both kinds of results
meet the same statistics and gates.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gem_platform.errors import GemError

FORMAT = "gem-sweep-results/1"


@dataclass(frozen=True)
class TrialRun:
    """One finished run as an arm's sample."""

    run_id: str
    arm: str
    seed: str
    metrics: dict[str, float]
    sweep_id: str | None = None
    parent_run_id: str | None = None


def finite_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite entries of a run summary (what a comparison can use)."""
    return {k: float(v) for k, v in summary.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def write_results(path: str | Path, header: dict[str, Any], trials: list[TrialRun]) -> Path:
    """Write (atomically: a partial file never replaces a good one) the header and trials."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, **header,
            "trials": [{"arm": t.arm, "seed": t.seed, "run_id": t.run_id, "metrics": t.metrics}
                       for t in trials]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def is_results_file(ident: str) -> bool:
    """Whether a compare argument names a results file: by its suffix, not by its existence
    (no sweep or run id ends in .json), so a mistyped path is reported as a missing file, not
    searched for in the MLflow store."""
    return ident.endswith(".json")


def load_results(path: str | Path) -> tuple[list[TrialRun], dict[str, Any]]:
    """(trials, header) of a results file; a clear error for anything else."""
    path = Path(path)
    fix = ("Pass a file written by `python -m gem_platform.sweep.inprocess SPEC --out FILE`, "
           "or a sweep id / run id from `gemctl runs`.")
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise GemError(f"Cannot read sweep results {path}: {err}.", fix) from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise GemError(f"{path} is not a sweep results file (no \"format\": \"{FORMAT}\").",
                       fix)
    sweep = str(body.get("sweep", path.stem))
    trials = []
    for i, t in enumerate(body.get("trials", [])):
        try:
            trials.append(TrialRun(run_id=str(t.get("run_id") or f"{sweep}/{t['arm']}/"
                                                                 f"seed{t['seed']}"),
                                   arm=str(t["arm"]), seed=str(t["seed"]),
                                   metrics={k: float(v) for k, v in t["metrics"].items()},
                                   sweep_id=sweep))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise GemError(f"{path}: trial {i} lacks arm, seed or numeric metrics.",
                           fix) from None
    if not trials:
        raise GemError(f"{path} holds no finished trials yet.", fix)
    header = {k: v for k, v in body.items() if k != "trials"}
    return trials, header
