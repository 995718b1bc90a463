"""MLflow tracking: one run per submission, params = the flattened recipe, metrics per step and
final, artifacts = the resolved recipe, the placement plan and a summary JSON.

The driver creates and closes the run (always FINISHED or FAILED); rank 0 of the training
workers logs step metrics into it by run id.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from gem_platform.errors import TrackingError
from gem_platform.net import connect_error

PARAM_VALUE_LIMIT = 6000
DEFAULT_DB = "mlflow.db"


def resolve_tracking_uri(configured: str | None) -> str:
    """Recipe value, else MLFLOW_TRACKING_URI, else a sqlite store in the working directory."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        uri = f"sqlite:///{Path.cwd() / DEFAULT_DB}"
    return uri


def check_reachable(uri: str, timeout: float = 3.0) -> None:
    """Fail fast (seconds, not minutes of retries) when a tracking server can't be reached."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("http", "https"):
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        err = connect_error(parsed.hostname or "", port, timeout)
        if err is not None:
            raise TrackingError(
                f"MLflow tracking server {uri} is unreachable ({err}).",
                "Start it (e.g. `mlflow server --host 127.0.0.1 --port 5000`), fix "
                "tracking.uri / MLFLOW_TRACKING_URI, or unset them to use ./mlflow.db.",
            )
    elif parsed.scheme == "sqlite":
        db = Path(uri.removeprefix("sqlite:///"))
        if not db.parent.exists():
            raise TrackingError(f"MLflow store {uri}: folder {db.parent} does not exist.",
                                "Create the folder or point tracking.uri elsewhere.")


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


class RunTracker:
    """A handle on one MLflow run, usable from the driver or (by run id) from a worker."""

    def __init__(self, uri: str, run_id: str) -> None:
        self.uri, self.run_id = uri, run_id
        self._client = _client(uri)

    @classmethod
    def start(cls, uri: str, experiment: str, run_name: str | None, params: dict[str, Any],
              tags: dict[str, str] | None = None) -> RunTracker:
        check_reachable(uri)
        client = _client(uri)
        try:
            exp = client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
            run = client.create_run(exp_id, run_name=run_name, tags=tags or {})
        except Exception as err:  # mlflow raises many types for an unusable store
            raise TrackingError(f"MLflow store {uri} can't be used: {err}.",
                                "Check tracking.uri / MLFLOW_TRACKING_URI.") from None
        tracker = cls(uri, run.info.run_id)
        tracker.log_params(params)
        return tracker

    @classmethod
    def reopen(cls, uri: str, run_id: str, params: dict[str, Any]) -> RunTracker:
        """Continue an existing run (resume): same recipe required, status back to RUNNING."""
        from gem_platform.errors import RecipeError

        check_reachable(uri)
        client = _client(uri)
        try:
            run = client.get_run(run_id)
        except Exception:
            raise TrackingError(
                f"There is no MLflow run {run_id!r} in {uri}.",
                "Pass the run id that gemctl submit printed (see the MLflow UI), and the same "
                "tracking store (tracking.uri / MLFLOW_TRACKING_URI).",
            ) from None
        recorded = run.data.params
        differ = sorted(k for k, v in params.items()
                        if k in recorded and recorded[k] != str(v)[:PARAM_VALUE_LIMIT])
        if differ:
            shown = ", ".join(f"{k} (run: {recorded[k]}, now: {params[k]})" for k in differ[:5])
            raise RecipeError(
                f"Run {run_id} was trained with a different recipe: {shown}.",
                "Resume with the recipe and --set overrides the run started with.",
            )
        client.update_run(run_id, status="RUNNING")
        return cls(uri, run_id)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:PARAM_VALUE_LIMIT]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in _clean(metrics).items()]
        for i in range(0, len(items), 500):
            self._client.log_batch(self.run_id, metrics=items[i : i + 500])

    def last_step(self, key: str = "train/loss") -> int:
        """The highest step recorded for ``key`` (0 if none): where a resumed run's record
        stands."""
        history = self._client.get_metric_history(self.run_id, key)
        return max((m.step for m in history), default=0)

    def log_text(self, text: str, artifact_file: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(artifact_file).name
            path.write_text(text)
            parent = str(Path(artifact_file).parent)
            self._client.log_artifact(self.run_id, str(path),
                                      artifact_path=None if parent == "." else parent)

    def log_json(self, obj: Any, artifact_file: str) -> None:
        self.log_text(json.dumps(obj, indent=2, sort_keys=True, default=str), artifact_file)

    def set_tag(self, key: str, value: str) -> None:
        self._client.set_tag(self.run_id, key, value)

    def finish(self, ok: bool, reason: str | None = None) -> None:
        if reason:
            self.set_tag("gem.failure_reason", reason[:5000])
        self._client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")

    def status(self) -> str:
        return self._client.get_run(self.run_id).info.status
