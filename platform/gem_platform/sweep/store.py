"""Where sweeps live in MLflow: the tags that tie a parent run to its child runs, and the
queries the runner (resume, no duplicates), ``compare`` and ``runs`` share."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # MLflow loads when a client is made, not when a command merely parses
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

TAG_PARENT = "mlflow.parentRunId"
TAG_RUN_NAME = "mlflow.runName"
TAG_SWEEP = "gem.sweep"
TAG_ROLE = "gem.sweep_role"
TAG_ARM = "gem.arm"
TAG_SEED = "gem.seed"
TAG_BASELINE = "gem.baseline"
TAG_RECIPE = "gem.recipe"  # the recipe a run trained (a sweep's parent: its base recipe)
TAG_FINGERPRINT = "gem.sweep_fingerprint"
ROLE_PARENT = "parent"
# A sweep's parent run params, one per arm: the arm's overrides, and its recipe's fingerprint
# (SweepPlan.arm_fingerprints).
PARAM_ARM = "sweep.arm."
PARAM_ARM_RECIPE = "sweep.recipe."
ROLE_CHILD = "child"


def arm_key(arm: str) -> str:
    """An arm's name as a parent run's param keys hold it: what MLflow refuses in a key (','
    and '=' of grid arm names, brackets) as '_'."""
    return re.sub(r"[^\w.\- :]", "_", arm)


@dataclass(frozen=True)
class SweepRef:
    """A sweep as found in MLflow: its id (the gem.sweep tag) and its parent run."""

    sweep_id: str
    parent: Run


def client(uri: str) -> MlflowClient:
    """A client whose store exists (a new sqlite file is set up once, under a lock)."""
    from gem_platform.tracking import client as tracking_client

    return tracking_client(uri)


def all_experiment_ids(c: MlflowClient) -> list[str]:
    return [e.experiment_id for e in c.search_experiments()]


def search(c: MlflowClient, filter_string: str, experiment_ids: list[str] | None = None,
           max_results: int = 1000) -> list[Run]:
    ids = experiment_ids or all_experiment_ids(c)
    if not ids:
        return []
    return list(c.search_runs(ids, filter_string, max_results=max_results,
                              order_by=["attributes.start_time DESC"]))


def parents_with_fingerprint(c: MlflowClient, experiment_id: str, fingerprint: str
                             ) -> list[Run]:
    """Parent runs of earlier launches of the same sweep, newest first."""
    return search(c, f"tags.`{TAG_FINGERPRINT}` = '{fingerprint}' and "
                     f"tags.`{TAG_ROLE}` = '{ROLE_PARENT}'", [experiment_id])


def find_sweep(c: MlflowClient, sweep_id: str) -> SweepRef | None:
    runs = search(c, f"tags.`{TAG_SWEEP}` = '{sweep_id}' and "
                     f"tags.`{TAG_ROLE}` = '{ROLE_PARENT}'")
    return SweepRef(sweep_id, runs[0]) if runs else None


def children(c: MlflowClient, parent: Run) -> list[Run]:
    """Child runs of a parent run (active ones; superseded attempts are deleted)."""
    return search(c, f"tags.`{TAG_PARENT}` = '{parent.info.run_id}'",
                  [parent.info.experiment_id])


def trial_runs(c: MlflowClient, experiment_id: str, sweep_id: str, arm: str, seed: int
               ) -> list[Run]:
    return search(c, f"tags.`{TAG_SWEEP}` = '{sweep_id}' and tags.`{TAG_ROLE}` = "
                     f"'{ROLE_CHILD}' and tags.`{TAG_ARM}` = '{arm}' and "
                     f"tags.`{TAG_SEED}` = '{seed}'", [experiment_id])
