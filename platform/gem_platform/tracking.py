"""MLflow tracking: one run per submission, params = the flattened recipe, metrics per step and
final, artifacts = the resolved recipe, the placement plan and a summary JSON.

The driver creates and closes the run (always FINISHED or FAILED); rank 0 of the training
workers logs step metrics into it by run id.

Contracts:

- Credentials never reach the store: every param, tag, text artifact and error message goes
  through :func:`gem_platform.net.redact` first.
- A new sqlite store is created once, under a file lock beside the database, so two first
  runs against the same fresh file don't race in MLflow's schema set-up.
- Every failure of the store (unreachable, locked, corrupt, refused) surfaces as a
  :class:`TrackingError` naming the (redacted) store, never as an MLflow or SQLAlchemy
  traceback.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, TypeVar

from gem_platform.errors import GemError, RecipeError, TrackingError
from gem_platform.file_lock import exclusive_lock
from gem_platform.interrupts import interrupt_in
from gem_platform.net import redact
from gem_platform.tracking_uri import (  # noqa: F401 (re-exported: where callers look)
    DEFAULT_DB,
    check_reachable,
    resolve_tracking_uri,
    sqlite_path,
)

PARAM_VALUE_LIMIT = 6000
_READY: set[str] = set()  # stores this process has already opened (schema in place)
T = TypeVar("T")


def store_error(uri: str, err: BaseException) -> TrackingError:
    """The clear error for any exception an MLflow call raised against ``uri``."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    return TrackingError(
        f"MLflow store {redact(uri)} can't be used: {type(err).__name__}: {redact(first)}.",
        "Check tracking.uri / MLFLOW_TRACKING_URI (a reachable server, or a writable sqlite "
        "file made by this MLflow version).")


@contextlib.contextmanager
def _store_lock(db: Path) -> Iterator[None]:
    """An exclusive lock beside the sqlite file, held while its schema is set up."""
    with exclusive_lock(db.with_name(db.name + ".lock")):
        yield


def client(uri: str):
    """An MlflowClient on ``uri`` whose store exists: a new sqlite file is created (schema and
    all) once, under a file lock, so concurrent first runs don't race. Raises TrackingError."""
    from mlflow.tracking import MlflowClient

    db = sqlite_path(uri)
    if db is None or uri in _READY:
        try:  # a database store connects (and loads its driver) here
            return MlflowClient(tracking_uri=uri)
        except Exception as err:
            raise store_error(uri, err) from None
    check_reachable(uri)
    try:
        with _store_lock(db):
            c = MlflowClient(tracking_uri=uri)
            c.search_experiments(max_results=1)  # builds the store (and its schema) now
    except GemError:
        raise
    except Exception as err:  # MLflow, SQLAlchemy and alembic raise many types
        raise store_error(uri, err) from None
    _READY.add(uri)
    return c


_client = client


def _tracked(method: Callable[..., T]) -> Callable[..., T]:
    """Turn any store failure inside a RunTracker method into a TrackingError."""

    @functools.wraps(method)
    def wrapper(self: RunTracker, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except GemError:
            raise
        except Exception as err:
            raise store_error(self.uri, err) from None

    return wrapper


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


class RunTracker:
    """A handle on one MLflow run, usable from the driver or (by run id) from a worker.

    Every method raises TrackingError (naming the redacted store) when the store fails, and
    redacts credentials from what it records."""

    def __init__(self, uri: str, run_id: str, store_client: Any = None) -> None:
        self.uri, self.run_id = uri, run_id
        self._client = store_client or _client(uri)
        self._system_metrics: Any = None  # sampled on the driver that opened the run
        self.status_before: str | None = None  # a reopened run's status before the resume

    @classmethod
    def start(cls, uri: str, experiment: str, run_name: str | None, params: dict[str, Any],
              tags: dict[str, str] | None = None) -> RunTracker:
        """Open a new run. What the store would refuse (a key, a name) is refused before the
        run exists; a failure after it exists leaves it FAILED with the reason (KILLED when
        interrupted), never RUNNING."""
        tags = {k: redact(str(v)) for k, v in (tags or {}).items()}
        check_run_inputs(experiment, run_name, params, tags)
        check_reachable(uri)
        c = _client(uri)
        try:
            exp = c.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else c.create_experiment(experiment)
            run = c.create_run(exp_id, run_name=run_name and redact(run_name), tags=tags)
        except Exception as err:  # mlflow raises many types for an unusable store
            raise store_error(uri, err) from None
        tracker = cls(uri, run.info.run_id, c)
        with tracker.closed_on_error(interrupted="KILLED"):
            tracker.log_params(params)
            tracker._record_provenance(params, resumed=False)
        return tracker

    @contextlib.contextmanager
    def closed_on_error(self, interrupted: str = "FAILED") -> Iterator[RunTracker]:
        """While active, an exception (an interrupt included) that leaves this run RUNNING
        closes it FAILED (``interrupted`` on Ctrl-C/SIGTERM) with the reason, then
        propagates. A run already closed by a handler inside keeps its status."""
        try:
            yield self
        except BaseException as err:
            stopped = interrupt_in(err) is not None
            reason = "interrupted" if stopped else f"{type(err).__name__}: {err}"
            with contextlib.suppress(Exception):  # the store may be what failed
                if self._client.get_run(self.run_id).info.status == "RUNNING":
                    self.set_tag("gem.failure_reason", reason[:5000])
                    self.stop_system_metrics()
                    self._client.set_terminated(self.run_id,
                                                status=interrupted if stopped else "FAILED")
            raise

    def _record_provenance(self, params: dict[str, Any], resumed: bool) -> None:
        """Code version, dataset input, environment and system metrics (provenance.py)."""
        from gem_platform.provenance import record_run

        self._system_metrics = record_run(self, params, resumed)

    def stop_system_metrics(self) -> None:
        """Stop sampling system metrics (finish does; callers that end a run otherwise too)."""
        if self._system_metrics is not None:
            self._system_metrics.stop()
            self._system_metrics = None

    @classmethod
    def reopen(cls, uri: str, run_id: str, params: dict[str, Any],
               may_differ: Collection[str] = ()) -> RunTracker:
        """Continue an existing run (resume): same recipe required (apart from the params
        in ``may_differ``, which keep their first values in the record), status back to
        RUNNING."""
        check_reachable(uri)
        c = _client(uri)
        try:
            run = c.get_run(run_id)
        except Exception:
            raise TrackingError(
                f"There is no MLflow run {run_id[:100]!r} in {redact(uri)}.",
                "Pass the run id that gemctl submit printed (see the MLflow UI), and the same "
                "tracking store (tracking.uri / MLFLOW_TRACKING_URI).",
            ) from None
        recorded = run.data.params
        now = {k: param_value(v) for k, v in params.items()}
        differ = sorted(k for k, v in now.items()
                        if k in recorded and recorded[k] != v and k not in may_differ)
        if differ:
            shown = ", ".join(f"{k} (run: {recorded[k][:80]}, now: {now[k][:80]})"
                              for k in differ[:5])
            raise RecipeError(
                f"Run {run_id} was trained with a different recipe: {shown}.",
                "Resume with the recipe and --set overrides the run started with.",
            )
        try:
            c.update_run(run_id, status="RUNNING")
        except Exception as err:
            raise store_error(uri, err) from None
        try:
            tracker = cls(uri, run_id, c)
            tracker.status_before = run.info.status
            tracker._record_provenance(params, resumed=True)
        except BaseException:  # the run is not resumed after all: its status as it was
            if run.info.status != "RUNNING":
                with contextlib.suppress(Exception):
                    c.set_terminated(run_id, status=run.info.status)
            raise
        return tracker

    @_tracked
    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, param_value(v)) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[i : i + 100])

    @_tracked
    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in _clean(metrics).items()]
        for i in range(0, len(items), 500):
            self._client.log_batch(self.run_id, metrics=items[i : i + 500])

    @_tracked
    def last_step(self, key: str = "train/loss") -> int:
        """The highest step recorded for ``key`` (0 if none): where a resumed run's record
        stands."""
        history = self._client.get_metric_history(self.run_id, key)
        return max((m.step for m in history), default=0)

    @_tracked
    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` (credentials redacted) as the artifact ``artifact_file``."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(artifact_file).name
            path.write_text(redact(text))
            parent = str(Path(artifact_file).parent)
            self._client.log_artifact(self.run_id, str(path),
                                      artifact_path=None if parent == "." else parent)

    def log_json(self, obj: Any, artifact_file: str) -> None:
        self.log_text(json.dumps(obj, indent=2, sort_keys=True, default=str), artifact_file)

    @_tracked
    def set_tag(self, key: str, value: str) -> None:
        self._client.set_tag(self.run_id, key, redact(str(value)))

    @_tracked
    def finish(self, ok: bool, reason: str | None = None, status: str | None = None) -> None:
        """Close the run FINISHED (``ok``) or FAILED, or with ``status`` (KILLED: it was
        interrupted), recording ``reason``."""
        if reason:
            self.set_tag("gem.failure_reason", reason[:5000])
        self.stop_system_metrics()
        self._client.set_terminated(self.run_id,
                                    status=status or ("FINISHED" if ok else "FAILED"))

    @_tracked
    def restore_status(self, note: str) -> None:
        """Undo a reopen that trained nothing: the run gets back the status (and end time) it
        had before, and ``note`` says in the tag ``gem.resume_stopped`` why the resume
        stopped."""
        self.set_tag("gem.resume_stopped", note[:5000])
        self.stop_system_metrics()
        self._client.update_run(self.run_id, status=self.status_before)

    @_tracked
    def status(self) -> str:
        return self._client.get_run(self.run_id).info.status


def check_run_inputs(experiment: str, run_name: str | None, params: dict[str, Any],
                     tags: dict[str, str]) -> None:
    """Refuse, before a run is created, what the store would refuse once it exists: checked
    with MLflow's own validation (experiment name, each param and tag key and value)."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import (
        _validate_experiment_name,
        _validate_param,
        _validate_tag,
    )

    checks: list[tuple[str, Callable[[], Any]]] = [
        (f"experiment name {experiment[:80]!r} (tracking.experiment)",
         lambda: _validate_experiment_name(experiment))]
    if run_name:
        checks.append((f"run name {run_name[:80]!r} (tracking.run_name)",
                       lambda: _validate_tag("mlflow.runName", redact(run_name))))
    checks += [(f"param {k[:80]!r}", functools.partial(_validate_param, k, param_value(v)))
               for k, v in params.items()]
    checks += [(f"tag {k[:80]!r}", functools.partial(_validate_tag, k, v))
               for k, v in tags.items()]
    for what, check in checks:
        try:
            check()
        except MlflowException as err:
            raise RecipeError(
                f"MLflow would refuse the run's {what}: {redact(err.message)[:300]}",
                "Rename it (tracking.tags keys and arm names take letters, digits and "
                "_ - . : / or space); `gemctl validate` checks a recipe the same way.") from None


def param_value(value: Any) -> str:
    """How a param is recorded: as text, credentials redacted, cut to MLflow's limit."""
    return redact(str(value))[:PARAM_VALUE_LIMIT]
