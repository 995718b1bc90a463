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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gem_platform.errors import GemError
from gem_platform.json_results import write_json

FORMAT = "gem-sweep-results/1"
MAX_RESULTS_BYTES = 1 << 30  # far beyond any sweep's results; a larger file is a mistake
COMPARISON_FORMAT = "gem-comparison/1"
# How many trials trained at once on the trial's machine (in-process sweeps, --parallel): above
# 1 its QPS and MFU are a share of the machine, not a speed figure.
CONCURRENT_TRIALS = "trial/concurrent_trials"
TRIAL_WALL_S = "trial/wall_s"  # seconds a trial took, start-up included


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
    # the accelerator it trained on ("NVIDIA H200", "cpu (2 cores)"), where recorded: the same
    # seed on another card is another sample, not the same trial
    device: str | None = None
    # metric -> [(step, value), ...] as the run logged them (results files of in-process
    # sweeps; tracked runs keep theirs in MLflow)
    history: dict[str, list[tuple[int, float]]] | None = None


def finite_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite entries of a run summary (what a comparison can use)."""
    return {k: float(v) for k, v in summary.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def write_results(path: str | Path, header: dict[str, Any], trials: list[TrialRun]) -> Path:
    """Write (atomically: a partial file never replaces a good one) the header and trials.
    The header's seeds, and the devices and commits its trials trained on, are those its
    trials hold, whichever call trained them (a resumed or merged file lists them all; its
    ``device`` and ``provenance`` stay the record of the call that wrote it last)."""
    body = {"format": FORMAT, **header, "trials": [_trial_dict(t) for t in trials]}
    if trials:
        body["seeds"] = sorted({int(t.seed) for t in trials})
        body["devices"] = sorted({t.device for t in trials if t.device})
        body["commits"] = sorted({t.commit for t in trials if t.commit})
    return write_json(path, body)


def trial_key(arm: str, seed: str | int) -> str:
    """'arm/seed': a trial's name in a results file's ``rounds``."""
    return f"{arm}/{seed}"


def rounds_of(header: Mapping[str, Any], trials: Iterable[TrialRun] = ()) -> list[list[str]]:
    """A results file's ``rounds``: the trials (``trial_key``) each call that trained into it
    added, in order; each is a point at which its gates could have been read. A file written
    before rounds were recorded, or whose rounds are malformed, gets its ``trials`` as one
    round."""
    raw = header.get("rounds")
    if isinstance(raw, list) and all(isinstance(r, list) and all(isinstance(k, str) for k in r)
                                     for r in raw):
        return [list(r) for r in raw]
    earlier = [trial_key(t.arm, t.seed) for t in trials]
    return [earlier] if earlier else []


def looks_of(rounds: Iterable[Iterable[str]], arm: str, baseline: str,
             seeds: Iterable[str]) -> list[int]:
    """The paired seed counts of ``arm`` against ``baseline`` after each round (counting only
    ``seeds``, those the gate pairs): the counts at which its gate could have been read."""
    pairable, have, looks = set(seeds), {arm: set(), baseline: set()}, []
    for keys in rounds:
        for key in keys:
            name, _, seed = key.rpartition("/")
            if name in have and seed in pairable:
                have[name].add(seed)
        n = len(have[arm] & have[baseline])
        if n >= 2 and (not looks or n != looks[-1]):
            looks.append(n)
    return looks


def seed_devices(runs: Iterable[TrialRun]) -> dict[str, str]:
    """Seed -> the device its run trained on, for the runs that recorded one."""
    return {r.seed: r.device for r in runs if r.device}


def cross_device_seeds(devices: Mapping[str, str], partner: Mapping[str, str]) -> list[str]:
    """The seeds of ``devices`` (seed -> the device its run trained on) whose run in
    ``partner`` (the baseline's, seed -> device) trained on another device, both recorded.
    Such a pair is not one trial twice with one change (the same seed and commit trained
    0.58% apart in NE on an H100 and an H200: docs/quality), so it is not paired."""
    return [seed for seed, device in devices.items() if partner.get(seed, device) != device]


def _trial_dict(t: TrialRun) -> dict[str, Any]:
    out: dict[str, Any] = {"arm": t.arm, "seed": t.seed, "run_id": t.run_id,
                           "metrics": t.metrics}
    if t.commit:
        out["commit"] = t.commit
    if t.device:
        out["device"] = t.device
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
        if path.stat().st_size > MAX_RESULTS_BYTES:
            raise GemError(f"Sweep results {path} are {path.stat().st_size:,} bytes, more than "
                           f"any results file ({MAX_RESULTS_BYTES:,}).", _FIX)
        body = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # unreadable, not UTF-8, not JSON, a NUL in the path
        raise GemError(f"Cannot read sweep results {str(path)[:200]}: {str(err)[:200]}.",
                       _FIX) from None
    except RecursionError:
        raise GemError(f"Cannot read sweep results {path}: its JSON nests too deeply.",
                       _FIX) from None
    nested = body.get("comparison") if isinstance(body, dict) else None
    if isinstance(nested, dict) and nested.get("format") == COMPARISON_FORMAT:
        body = nested  # `gemctl sweep --json`: the sweep's outcome around its comparison
    try:
        if isinstance(body, dict) and body.get("format") == FORMAT:
            trials = _sweep_trials(path, body)
        elif isinstance(body, dict) and body.get("format") == COMPARISON_FORMAT:
            trials = _comparison_trials(path, body)
            body["tasks"] = [_text(t, "a task") for t in _listed(body.get("tasks") or [],
                                                                   "tasks")]
        else:
            raise GemError(f"{path} is not a sweep results file (no \"format\": \"{FORMAT}\" "
                           f"or \"{COMPARISON_FORMAT}\").", _FIX)
    except _Malformed as err:
        raise GemError(f"{path}: {err}.", _FIX) from None
    if not trials:
        raise GemError(f"{path} holds no finished trials yet.", _FIX)
    if not isinstance(body.get("baseline"), str | None):
        raise GemError(f"{path}: its baseline is {type(body['baseline']).__name__}, not the "
                       "name of an arm.", _FIX)
    header = {k: v for k, v in body.items() if k not in ("trials", "arms")}
    if body.get("format") == FORMAT:
        header["arms"] = body.get("arms")
    return trials, header


_FIX = ("Pass a file written by `python -m gem_platform.sweep.inprocess SPEC --out FILE` or "
        "by `gemctl compare ... --json > FILE`, or a sweep id / run id from `gemctl runs`.")


class _Malformed(ValueError):
    """A value of a results file that is not what its format says."""


def _text(value: Any, what: str) -> str:
    """A name or id: JSON text or an integer (a seed), as text."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise _Malformed(f"{what} is {type(value).__name__}, not text")


def _number(value: Any, what: str) -> float:
    """A metric value: a JSON number, null-free; "nan"/"inf" as a comparison writes them."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _Malformed(f"{what} is {type(value).__name__}, not a number")
    try:
        return float(value)
    except (ValueError, OverflowError):
        raise _Malformed(f"{what} {str(value)[:40]!r} is not a number") from None


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Malformed(f"{what} is {type(value).__name__}, not an object")
    return value


def _listed(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _Malformed(f"{what} is {type(value).__name__}, not a list")
    return value


def _history(raw: Any) -> dict[str, list[tuple[int, float]]] | None:
    if raw is None:
        return None
    out = {}
    for k, pts in _mapping(raw, "history").items():
        steps = []
        for pt in _listed(pts, f"history of {k[:40]!r}"):
            step, value = _listed(pt, "a history point")
            steps.append((int(_number(step, "a step")), _number(value, "a history value")))
        out[k] = steps
    return out


def _sweep_trials(path: Path, body: dict[str, Any]) -> list[TrialRun]:
    """The file's trials; one written before trials recorded their device takes the header's
    (the machine that last wrote the file, theirs unless it was resumed on another)."""
    sweep = _text(body.get("sweep", path.stem), "sweep") if "sweep" in body else path.stem
    written_on = (body.get("device") or {}).get("device") \
        if isinstance(body.get("device"), dict) else None
    trials = []
    for i, t in enumerate(_listed(body.get("trials", []), "trials")):
        try:
            t = _mapping(t, "the trial")
            arm, seed = _text(t["arm"], "arm"), _text(t["seed"], "seed")
            commit, device = t.get("commit"), t.get("device", written_on)
            trials.append(TrialRun(
                run_id=_text(t.get("run_id") or f"{sweep}/{arm}/seed{seed}", "run_id"),
                arm=arm, seed=seed, sweep_id=sweep,
                metrics={k: _number(v, k[:60]) for k, v in _mapping(t["metrics"],
                                                                     "metrics").items()},
                commit=None if commit is None else _text(commit, "commit"),
                device=None if device is None else _text(device, "device"),
                history=_history(t.get("history"))))
        except KeyError as err:
            raise GemError(f"{path}: trial {i} lacks {err}.", _FIX) from None
        except (_Malformed, ValueError, OverflowError) as err:
            raise GemError(f"{path}: trial {i}: {err}.", _FIX) from None
    return trials


def _comparison_trials(path: Path, body: dict[str, Any]) -> list[TrialRun]:
    """Rebuild each run of a comparison from its arms' per-run values."""
    sweeps = body.get("sweep_ids") or [path.stem]
    trials = []
    for a in _listed(body.get("arms") or [], "arms"):
        try:
            a = _mapping(a, "an arm")
            arm = _text(a["arm"], "arm")
            seeds = [_text(s, "a seed") for s in _listed(a["seeds"], "seeds")]
            run_ids = [_text(r, "a run id") for r in _listed(a["run_ids"], "run_ids")]
            values = {k: _listed(v, k[:60]) for k, v in _mapping(a["per_seed"],
                                                                  "per_seed").items()}
            commits, devices = ({k: _text(v, what) for k, v in
                                 _mapping(a.get(key) or {}, key).items()}
                                for key, what in (("commits", "a commit"),
                                                  ("devices", "a device")))
            sweep = _text(sweeps[0], "sweep id") if isinstance(sweeps, list) and \
                len(sweeps) == 1 else None
            for i, (seed, run_id) in enumerate(zip(seeds, run_ids, strict=True)):
                metrics = {k: _number(v[i], k[:60]) for k, v in values.items()
                           if v[i] is not None}
                trials.append(TrialRun(run_id, arm, seed, metrics, sweep_id=sweep,
                                       commit=commits.get(seed), device=devices.get(seed)))
        except (KeyError, IndexError, ValueError, _Malformed) as err:
            arm_name = a.get("arm") if isinstance(a, dict) else a
            raise GemError(f"{path}: arm {str(arm_name)[:60]!r} lacks seeds, run_ids or "
                           f"per-run values (per_seed): {str(err)[:120]}.", _FIX) from None
    return trials
