"""One results file from several: the trials of one sweep trained in separate processes (e.g.
one process per arm and seed sharing a GPU), each writing its own ``--out``.

Files merge only when they hold the same sweep and baseline, the same recipe for every arm
they share, and the same datasets. A trial (arm, seed) found in several files is kept once,
and only when its eval metrics agree bit for bit (deterministic trials do); otherwise the
merge is refused, naming the trial. Each trial keeps its own commit and device, so ``gemctl
compare`` still says which trials came from which code and which card.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gem_platform.errors import GemError
from gem_platform.sweep.results import TrialRun, load_results, rounds_of, write_results

_FIX = "Merge only the results files of one sweep, trained on the same data and recipes."


def _digests(header: dict[str, Any]) -> list[str]:
    datasets = (header.get("provenance") or {}).get("datasets") or {}
    return sorted(str(d.get("digest")) for d in datasets.values() if isinstance(d, dict))


def _check_same_sweep(path: Path, header: dict[str, Any], into: dict[str, Any]) -> None:
    for key in ("sweep", "baseline"):
        if header.get(key) != into.get(key):
            raise GemError(f"{path} holds {key} {header.get(key)!r}, the first file "
                           f"{into.get(key)!r}.", _FIX)
    if _digests(header) != _digests(into):
        raise GemError(f"{path} was trained on other data (dataset digests "
                       f"{_digests(header)} vs {_digests(into)}).", _FIX)
    mine, theirs = header.get("recipes") or {}, into.get("recipes") or {}
    changed = sorted(a for a in mine if a in theirs and mine[a] != theirs[a])
    if changed:
        raise GemError(f"{path} trained arm(s) {changed} with other recipes than the first "
                       "file.", _FIX)


def _same_result(a: TrialRun, b: TrialRun) -> bool:
    keys = {k for k in a.metrics if k.startswith("eval/")} | \
        {k for k in b.metrics if k.startswith("eval/")}
    return all(a.metrics.get(k) == b.metrics.get(k) for k in keys)


def _union_header(into: dict[str, Any], header: dict[str, Any], trials: list[TrialRun]
                  ) -> None:
    """``header``'s arms, recipes, determinism record and rounds (the trials of each not
    already in ``into``'s rounds; ``trials`` are its file's) added to ``into``'s."""
    seen = {k for r in into["rounds"] for k in r}
    into["rounds"] += [fresh for r in rounds_of(header, trials)
                       if (fresh := [k for k in r if k not in seen])]
    for key in ("arms", "recipes"):
        into[key] = {**(header.get(key) or {}), **(into.get(key) or {})}
    prov, more = into.setdefault("provenance", {}), header.get("provenance") or {}
    prov["deterministic"] = {**(more.get("deterministic") or {}),
                             **(prov.get("deterministic") or {})}


def merge_results(paths: list[str | Path], out: str | Path) -> list[TrialRun]:
    """Merge the results files ``paths`` into ``out`` (which may be one of them); returns the
    merged trials. GemError (nothing written) where the files do not belong together."""
    if not paths:
        raise GemError("No results files to merge.", "Pass at least one --merge FILE.")
    trials, header = load_results(paths[0])
    header.pop("format", None)
    header["rounds"] = rounds_of(header, trials)
    kept = {(t.arm, t.seed): t for t in trials}
    for path in map(Path, paths[1:]):
        more, more_header = load_results(path)
        _check_same_sweep(path, more_header, header)
        for t in more:
            known = kept.get((t.arm, t.seed))
            if known is None:
                kept[(t.arm, t.seed)] = t
            elif not _same_result(known, t):
                raise GemError(f"{path}: trial {t.arm} seed {t.seed} differs from the same "
                               "trial in an earlier file (eval metrics not identical).",
                               "Keep one of the two files' trial; deterministic trials of "
                               "the same code agree bit for bit.")
        _union_header(header, more_header, more)
    header.setdefault("provenance", {})["seeds"] = sorted({int(s) for _, s in kept})
    merged = list(kept.values())
    write_results(out, header, merged)
    return merged
