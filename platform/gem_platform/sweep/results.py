"""Trial results as plain records, and the JSON files that hold them.

A sweep's trials normally live in MLflow (one child run each). A sweep run in-process, on a
machine without Ray or an MLflow server (a lone GPU box), writes the same records to a JSON
file instead (``gem-sweep-results/1``); ``gemctl compare --json`` writes a comparison
(``gem-comparison/1``) that keeps every run's values. ``gemctl compare`` reads both like a
sweep id, so every kind of result meets the same statistics and gates.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gem_platform.errors import GemError

FORMAT = "gem-sweep-results/1"
COMPARISON_FORMAT = "gem-comparison/1"


@dataclass(frozen=True)
class TrialRun:
    """One finished run as an arm's sample."""

    run_id: str
    arm: str
    seed: str
    metrics: dict[str, float]
    sweep_id: str | None = None
    parent_run_id: str | None = None
    commit: str | None = None  # git commit of the code that trained it, where recorded
    # metric -> [(step, value), ...] as the run logged them (results files of in-process
    # sweeps; tracked runs keep theirs in MLflow)
    history: dict[str, list[tuple[int, float]]] | None = None


def finite_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite entries of a run summary (what a comparison can use)."""
    return {k: float(v) for k, v in summary.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def write_results(path: str | Path, header: dict[str, Any], trials: list[TrialRun]) -> Path:
    """Write (atomically: a partial file never replaces a good one) the header and trials."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, **header, "trials": [_trial_dict(t) for t in trials]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def _trial_dict(t: TrialRun) -> dict[str, Any]:
    out: dict[str, Any] = {"arm": t.arm, "seed": t.seed, "run_id": t.run_id,
                           "metrics": t.metrics}
    if t.commit:
        out["commit"] = t.commit
    if t.history:
        out["history"] = {k: [[int(s), float(v)] for s, v in pts]
                          for k, pts in t.history.items()}
    return out


def is_results_file(ident: str) -> bool:
    """Whether a compare argument names a results file: by its suffix, not by its existence
    (no sweep or run id ends in .json), so a mistyped path is reported as a missing file, not
    searched for in the MLflow store."""
    return ident.endswith(".json")


def load_results(path: str | Path) -> tuple[list[TrialRun], dict[str, Any]]:
    """(trials, header) of a results file, a comparison written by ``gemctl compare --json``
    or the outcome of ``gemctl sweep --json`` (its comparison); a clear error for anything
    else."""
    path = Path(path)
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise GemError(f"Cannot read sweep results {path}: {err}.", _FIX) from None
    nested = body.get("comparison") if isinstance(body, dict) else None
    if isinstance(nested, dict) and nested.get("format") == COMPARISON_FORMAT:
        body = nested  # `gemctl sweep --json`: the sweep's outcome around its comparison
    if isinstance(body, dict) and body.get("format") == FORMAT:
        trials = _sweep_trials(path, body)
    elif isinstance(body, dict) and body.get("format") == COMPARISON_FORMAT:
        trials = _comparison_trials(path, body)
    else:
        raise GemError(f"{path} is not a sweep results file (no \"format\": \"{FORMAT}\" or "
                       f"\"{COMPARISON_FORMAT}\").", _FIX)
    if not trials:
        raise GemError(f"{path} holds no finished trials yet.", _FIX)
    header = {k: v for k, v in body.items() if k not in ("trials", "arms")}
    if body.get("format") == FORMAT:
        header["arms"] = body.get("arms")
    return trials, header


_FIX = ("Pass a file written by `python -m gem_platform.sweep.inprocess SPEC --out FILE` or "
        "by `gemctl compare ... --json > FILE`, or a sweep id / run id from `gemctl runs`.")


def _history(raw: Any) -> dict[str, list[tuple[int, float]]] | None:
    if not isinstance(raw, dict):
        return None
    return {str(k): [(int(s), float(v)) for s, v in pts] for k, pts in raw.items()}


def _sweep_trials(path: Path, body: dict[str, Any]) -> list[TrialRun]:
    sweep = str(body.get("sweep", path.stem))
    trials = []
    for i, t in enumerate(body.get("trials", [])):
        try:
            trials.append(TrialRun(run_id=str(t.get("run_id") or f"{sweep}/{t['arm']}/"
                                                                 f"seed{t['seed']}"),
                                   arm=str(t["arm"]), seed=str(t["seed"]),
                                   metrics={k: float(v) for k, v in t["metrics"].items()},
                                   sweep_id=sweep, commit=t.get("commit"),
                                   history=_history(t.get("history"))))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise GemError(f"{path}: trial {i} lacks arm, seed or numeric metrics.",
                           _FIX) from None
    return trials


def _comparison_trials(path: Path, body: dict[str, Any]) -> list[TrialRun]:
    """Rebuild each run of a comparison from its arms' per-run values."""
    sweeps = body.get("sweep_ids") or [path.stem]
    trials = []
    for a in body.get("arms") or []:
        try:
            arm, seeds, run_ids = str(a["arm"]), [str(s) for s in a["seeds"]], a["run_ids"]
            values = a["per_seed"]
            commits = a.get("commits") or {}
            for i, (seed, run_id) in enumerate(zip(seeds, run_ids, strict=True)):
                metrics = {k: float(v[i]) for k, v in values.items() if v[i] is not None}
                trials.append(TrialRun(str(run_id), arm, seed, metrics,
                                       sweep_id=str(sweeps[0]) if len(sweeps) == 1 else None,
                                       commit=commits.get(seed)))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            raise GemError(f"{path}: arm {a.get('arm') if isinstance(a, dict) else a!r} lacks "
                           "seeds, run_ids or per-run values (per_seed).", _FIX) from None
    return trials
