"""Recent runs across experiments, newest first: what ``gemctl runs`` lists so a user can pick
ids for ``gemctl compare`` without opening the UI."""

from __future__ import annotations

from dataclasses import dataclass

from gem_platform.sweep import store
from gem_platform.sweep.config import SweepError


@dataclass(frozen=True)
class RunRow:
    run_id: str
    name: str
    experiment: str
    status: str
    start_ms: int
    duration_s: float | None
    role: str  # "sweep" (parent), "trial" (child) or "run"
    sweep_id: str
    arm: str
    seed: str
    ne_ctr: float | None
    auc_ctr: float | None


def list_runs(uri: str, limit: int = 20, experiment: str | None = None,
              sweep_id: str | None = None, sweeps_only: bool = False) -> list[RunRow]:
    """Newest runs first; ``sweep_id`` narrows to one sweep (its parent and children)."""
    c = store.client(uri)
    experiments = {e.experiment_id: e.name for e in c.search_experiments()}
    if experiment is not None:
        ids = [i for i, name in experiments.items() if name == experiment]
        if not ids:
            known = ", ".join(sorted(experiments.values())) or "none yet"
            raise SweepError(f"No experiment {experiment!r} in {uri}.",
                             f"Known experiments: {known}.")
    else:
        ids = list(experiments)
    filters = []
    if sweep_id:
        filters.append(f"tags.`{store.TAG_SWEEP}` = '{sweep_id}'")
    if sweeps_only:
        filters.append(f"tags.`{store.TAG_ROLE}` = '{store.ROLE_PARENT}'")
    runs = store.search(c, " and ".join(filters), ids, max_results=limit) if ids else []
    rows = []
    for run in runs:
        tags, info, m = run.data.tags, run.info, run.data.metrics
        role = {store.ROLE_PARENT: "sweep", store.ROLE_CHILD: "trial"}.get(
            tags.get(store.TAG_ROLE, ""), "run")
        rows.append(RunRow(
            run_id=info.run_id, name=info.run_name or "", status=info.status,
            experiment=experiments.get(info.experiment_id, info.experiment_id),
            start_ms=info.start_time or 0,
            duration_s=(info.end_time - info.start_time) / 1000
            if info.end_time and info.start_time else None,
            role=role, sweep_id=tags.get(store.TAG_SWEEP, ""), arm=tags.get(store.TAG_ARM, ""),
            seed=tags.get(store.TAG_SEED, ""), ne_ctr=m.get("eval/ne_ctr"),
            auc_ctr=m.get("eval/auc_ctr"),
        ))
    return rows
