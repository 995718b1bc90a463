"""Run a sweep on Ray Tune: one MLflow parent run for the sweep, one child run per (arm,
seed) trial, at most ``max_concurrent`` trials at a time.

Launching the same spec again resumes it: the unfinished parent run with the same
fingerprint is reopened, Tune restores its experiment state (``Tuner.restore``), and each
trial skips itself when MLflow already holds its finished child run. A sweep that already
finished is reported, not rerun (``new=True`` starts a fresh one).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray.tune import Callback

from gem_platform.errors import GemError
from gem_platform.interrupts import interrupt_in
from gem_platform.launch import check_world_size, start_ray
from gem_platform.progress import Echo, TrialDone, draining
from gem_platform.provenance import TAG_COMMIT, TAG_DATASET
from gem_platform.sweep import store
from gem_platform.sweep.config import SweepError, SweepPlan
from gem_platform.sweep.trial import run_trial
from gem_platform.tracking import RunTracker, check_reachable

TUNE_STORAGE = "gem_runs/sweeps"
DRIVER_CPUS = 0.1  # a trial that drives a TorchTrainer (Tune refuses an empty request)


@dataclass
class SweepOutcome:
    sweep_id: str
    parent_run_id: str
    tracking_uri: str
    status: str  # FINISHED | FAILED | KILLED
    resumed: bool = False
    already_complete: bool = False
    child_run_ids: dict[tuple[str, int], str] = field(default_factory=dict)
    missing: list[tuple[str, int]] = field(default_factory=list)
    errors: dict[tuple[str, int], str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED"


def _prepare_data(plan: SweepPlan) -> None:
    """Generate each distinct dataset once, on the driver, before trials race for it."""
    from gem_platform.data.prepare import prepare_dataset

    seen: set[str] = set()
    for arm in plan.arms:
        recipe = arm.recipe
        meta = prepare_dataset(recipe.data) if recipe.data.path not in seen else None
        seen.add(recipe.data.path)
        if meta is not None:
            check_world_size(recipe, meta, recipe.parallel.workers)


def _trial_cpus(plan: SweepPlan) -> float:
    """CPUs a trial reserves: an in-process trial trains on its own CPUs; a trial that drives
    a TorchTrainer only waits, its workers reserve theirs."""
    return max(float(a.recipe.parallel.cpus_per_worker) if a.recipe.parallel.workers == 1
               else DRIVER_CPUS for a in plan.arms)


def _init_ray(plan: SweepPlan, address: str | None) -> bool:
    """Start (or connect to) Ray; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    # ray.init replaces the SIGTERM handler with one that exits at once; keep ours, so a
    # terminated sweep closes its parent run and can be resumed.
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        _start_ray(plan, address)
    finally:
        signal.signal(signal.SIGTERM, on_sigterm)
    return True


def _start_ray(plan: SweepPlan, address: str | None) -> None:
    per_trial = max(_trial_cpus(plan), max(
        a.recipe.parallel.workers * a.recipe.parallel.cpus_per_worker
        if a.recipe.parallel.workers > 1 else 0 for a in plan.arms))
    start_ray(address, int(per_trial * plan.max_concurrent) + 1)


def trial_commits(uri: str, parent_run_id: str) -> dict[str, list[str]]:
    """Commit -> the finished trials ("arm seed N") that trained with it."""
    c = store.client(uri)
    out: dict[str, list[str]] = {}
    for run in store.children(c, c.get_run(parent_run_id)):
        tags = run.data.tags
        if run.info.status == "FINISHED" and store.TAG_ARM in tags:
            out.setdefault(tags.get(TAG_COMMIT, "unknown"), []).append(
                f"{tags[store.TAG_ARM]} seed {tags.get(store.TAG_SEED)}")
    return out


def describe_commits(commits: dict[str, list[str]]) -> str:
    return "; ".join(f"commit {c[:12]}: {', '.join(sorted(t))}" for c, t in commits.items())


def check_code(plan: SweepPlan, run: Any, record: dict[str, Any], allow_code_change: bool,
               echo: Echo) -> None:
    """Refuse to resume a sweep whose trials so far trained with another commit (or another
    dataset) unless ``allow_code_change``; say which trials came from which commit."""
    tags, uri = run.data.tags, plan.arms[0].recipe.tracking.uri or ""
    sweep_id = tags[store.TAG_SWEEP]
    before, now = tags.get(TAG_COMMIT), record["code"]["commit"]
    data_before, data_now = tags.get(TAG_DATASET), _dataset_digests(record)
    if data_before and data_now and data_before != data_now:
        raise SweepError(f"Sweep {sweep_id} trained on dataset {data_before}; the data at "
                         f"its recipes' data.path is now {data_now}.",
                         "Restore the dataset it trained on, or start a fresh sweep with "
                         "--new.")
    if not before or not now or before == now:
        return
    commits = trial_commits(uri, run.info.run_id)
    trials = describe_commits(commits) or "no finished trials yet"
    if not allow_code_change:
        raise SweepError(f"Sweep {sweep_id} started with commit {before[:12]}; this code is "
                         f"commit {now[:12]}. Trials so far: {trials}.",
                         "Check out its commit to resume it, pass --allow-code-change to "
                         "finish it with this code (each trial records its commit), or "
                         "--new to start a fresh sweep.")
    echo(f"resuming sweep {sweep_id} with a code change (--allow-code-change): {trials}; "
         f"new trials train with commit {now[:12]}")


def _dataset_digests(record: dict[str, Any]) -> str:
    return ",".join(sorted({d["digest"] for d in record["datasets"].values() if d}))


def _record_parent(tracker: RunTracker, record: dict[str, Any]) -> None:
    """Fingerprint record, dataset inputs and digests on a new parent run."""
    from gem_platform.provenance import log_dataset

    tracker.log_json(record, "fingerprint.json")
    for dataset in record["datasets"].values():
        if dataset:
            log_dataset(tracker.uri, tracker.run_id, dataset, "training")
    if _dataset_digests(record):
        tracker.set_tag(TAG_DATASET, _dataset_digests(record))


def _open_parent(plan: SweepPlan, uri: str, new: bool, echo: Echo,
                 allow_code_change: bool = False) -> tuple[RunTracker, str, str, bool]:
    """Reuse the latest parent with this fingerprint unless ``new``; else create one.
    A parent that is resumed must have trained with this commit (see ``check_code``).

    Returns (tracker, sweep id, status of the reused parent or '', resumed).
    """
    c = store.client(uri)
    fingerprint = plan.fingerprint()
    record = plan.fingerprint_record()
    exp = c.get_experiment_by_name(plan.experiment)
    if exp is not None and not new:
        earlier = store.parents_with_fingerprint(c, exp.experiment_id, fingerprint)
        if earlier:
            run = earlier[0]
            sweep_id = run.data.tags[store.TAG_SWEEP]
            if run.info.status == "FINISHED":
                return RunTracker(uri, run.info.run_id), sweep_id, "FINISHED", True
            check_code(plan, run, record, allow_code_change, echo)
            tracker = RunTracker.reopen(uri, run.info.run_id, {})
            echo(f"resuming sweep {sweep_id} (parent run {run.info.run_id}, was "
                 f"{run.info.status})")
            return tracker, sweep_id, run.info.status, True
    sweep_id = f"{plan.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    baseline = plan.own_baseline
    params = {"sweep.name": plan.name, "sweep.base": plan.base_path,
              "sweep.seeds": ",".join(map(str, plan.seeds)),
              "sweep.max_concurrent": plan.max_concurrent, "sweep.baseline": baseline,
              **{arm_param(a.name): " ".join(a.overrides) or "(base)" for a in plan.arms},
              **{store.PARAM_ARM_RECIPE + store.arm_key(arm): fingerprint
                 for arm, fingerprint in plan.arm_fingerprints().items()}}
    tags = {store.TAG_SWEEP: sweep_id, store.TAG_ROLE: store.ROLE_PARENT,
            store.TAG_BASELINE: baseline, store.TAG_FINGERPRINT: fingerprint,
            store.TAG_RECIPE: plan.arms[0].recipe.name}
    tracker = RunTracker.start(uri, plan.experiment, sweep_id, params, tags)
    with tracker.closed_on_error():
        tracker.log_json(plan.to_dict(), "sweep.json")
        _record_parent(tracker, record)
    echo(f"sweep {sweep_id}: {len(plan.arms)} arms x {len(plan.seeds)} seeds, parent run "
         f"{tracker.run_id}")
    return tracker, sweep_id, "", False


def arm_param(arm: str) -> str:
    """The parent run's param naming an arm's overrides: ``sweep.arm.<arm>``
    (``store.arm_key``)."""
    return store.PARAM_ARM + store.arm_key(arm)


def _finished_children(uri: str, parent_run_id: str) -> dict[tuple[str, int], str]:
    c = store.client(uri)
    parent = c.get_run(parent_run_id)
    out: dict[tuple[str, int], str] = {}
    for run in store.children(c, parent):
        tags = run.data.tags
        if run.info.status == "FINISHED" and store.TAG_ARM in tags:
            out.setdefault((tags[store.TAG_ARM], int(tags[store.TAG_SEED])), run.info.run_id)
    return out


class Progress(Callback):
    """A TrialDone event per finished or failed trial (the trials send their own step events).

    Tune pickles callbacks with its experiment state and a restored sweep runs the unpickled
    copy; the echo function (a console) does not pickle, so a restored copy sends its events
    to the echo of the sweep that restored it (``live``), else prints them.
    """

    live: Echo | None = None  # the echo of the sweep running in this process

    def __init__(self, echo: Echo) -> None:
        self.echo = echo
        Progress.live = echo

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.echo = Progress.live or print

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        r, c = trial.last_result or {}, trial.config["trial"]
        if "run_id" not in r:
            return
        self.echo(TrialDone(f"{c['arm']} seed {c['seed']}",
                            "already recorded" if r.get("reused") else "finished",
                            r.get("eval/ne_ctr", math.nan), r.get("eval/auc_ctr", math.nan),
                            f"run {r['run_id']}"))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        c = trial.config["trial"]
        self.echo(TrialDone(f"{c['arm']} seed {c['seed']}", "FAILED"))


def _tuner(plan: SweepPlan, sweep_id: str, parent_run_id: str, todo: list[tuple[str, int]],
           echo: Echo, events: Any) -> Any:
    """The Tuner of the trials still to run (restored where Tune's state allows); the trials
    send their progress events to the Ray queue ``events``."""
    from ray import tune

    plan_dict = {"sweep_id": sweep_id, "parent_run_id": parent_run_id, "progress": events,
                 "recipes": {a.name: a.recipe.model_dump(mode="json") for a in plan.arms}}
    trainable = tune.with_resources(tune.with_parameters(run_trial, plan_dict=plan_dict),
                                    {"cpu": _trial_cpus(plan)})
    storage = Path(TUNE_STORAGE).resolve()
    path = storage / sweep_id
    callback = Progress(echo)  # also what a restored copy of Tune's callback reports to
    if tune.Tuner.can_restore(path):
        try:
            tuner = tune.Tuner.restore(str(path), trainable, resume_unfinished=True,
                                       restart_errored=True)
            echo(f"restored Ray Tune state from {path}")
            return tuner
        except Exception as err:  # a state cut short by a hard kill: MLflow still knows
            echo(f"Ray Tune state in {path} is unreadable ({type(err).__name__}); running "
                 "the unrecorded trials afresh")
    trials = [{"arm": arm, "seed": seed} for arm, seed in todo]
    if path.exists():
        shutil.rmtree(path)
    return tune.Tuner(
        trainable,
        param_space={"trial": tune.grid_search(trials)},
        tune_config=tune.TuneConfig(max_concurrent_trials=plan.max_concurrent,
                                    reuse_actors=True),
        run_config=tune.RunConfig(name=sweep_id, storage_path=str(storage), verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=0),
                                  callbacks=[callback]),
    )


def _trial_errors(results: Any) -> dict[tuple[str, int], str]:
    errors = {}
    for result in results:
        if result.error is not None:
            cfg = result.config["trial"]
            first = str(result.error).strip().splitlines()
            errors[(cfg["arm"], int(cfg["seed"]))] = first[-1] if first else "failed"
    return errors


def _close(tracker: RunTracker, status: str, reason: str | None = None) -> None:
    tracker.stop_system_metrics()
    c = store.client(tracker.uri)
    if reason:
        c.set_tag(tracker.run_id, "gem.failure_reason", reason[:5000])
    elif "gem.failure_reason" in c.get_run(tracker.run_id).data.tags:
        c.delete_tag(tracker.run_id, "gem.failure_reason")  # a resumed sweep that completed
    c.set_terminated(tracker.run_id, status=status)


def _summarize(outcome: SweepOutcome, plan: SweepPlan, echo: Echo) -> None:
    """Log the comparison of the finished trials (with the spec's gates) on the parent run."""
    from gem_platform.sweep.compare import compare
    from gem_platform.sweep.summary import log_comparison

    cmp = compare(outcome.tracking_uri, [outcome.sweep_id], plan.own_baseline, plan.gates)
    log_comparison(outcome.tracking_uri, outcome.parent_run_id, cmp)
    commits = trial_commits(outcome.tracking_uri, outcome.parent_run_id)
    if len(commits) > 1:
        echo(f"sweep {outcome.sweep_id} holds trials of {len(commits)} commits: "
             f"{describe_commits(commits)}")


def run_sweep(plan: SweepPlan, *, new: bool = False, address: str | None = None,
              echo: Echo = print, allow_code_change: bool = False
              ) -> SweepOutcome:
    """Run (or resume) the sweep; the parent run ends FINISHED, FAILED or KILLED, carrying
    the comparison of its finished trials (``summary``). Resuming a sweep started with
    another commit raises SweepError unless ``allow_code_change``."""
    import ray
    from ray.util.queue import Queue

    uri = plan.arms[0].recipe.tracking.uri or ""
    check_reachable(uri)
    address = address or os.environ.get("RAY_ADDRESS") or None
    _prepare_data(plan)
    tracker, sweep_id, earlier_status, resumed = _open_parent(plan, uri, new, echo,
                                                              allow_code_change)
    # Whatever escapes below leaves the parent FAILED (KILLED on an interrupt), never RUNNING.
    with tracker.closed_on_error(interrupted="KILLED"):
        done = _finished_children(uri, tracker.run_id)
        todo = [t for t in plan.trials() if t not in done]
        outcome = SweepOutcome(sweep_id, tracker.run_id, uri, "FINISHED", resumed=resumed)
        if earlier_status == "FINISHED" and not todo:
            outcome.already_complete = True
            outcome.child_run_ids = done
            echo(f"sweep {sweep_id} is already complete ({len(done)} runs); pass --new to run it "
                 "again")
            return outcome
        if done:
            echo(f"{len(done)} of {len(plan.trials())} trials already recorded; running "
                 f"{len(todo)}")
        started = False
        try:
            started = _init_ray(plan, address)
            events = Queue(actor_options={"num_cpus": 0})
            tuner = _tuner(plan, sweep_id, tracker.run_id, todo, echo, events)
            with draining(events, echo):
                results = tuner.fit()
            outcome.errors = _trial_errors(results)
        except BaseException as err:
            interrupted = interrupt_in(err) is not None
            reason = "interrupted" if interrupted else f"{type(err).__name__}: {err}"
            _close(tracker, "KILLED" if interrupted else "FAILED",
                   f"{reason}; run the same command again to resume")
            if started:
                ray.shutdown()
            if interrupted:
                raise KeyboardInterrupt(reason) from None
            if isinstance(err, GemError):
                raise
            raise RuntimeError(f"sweep {sweep_id} stopped: {reason}") from err
        if started:
            ray.shutdown()
        outcome.child_run_ids = _finished_children(uri, tracker.run_id)
        outcome.missing = [t for t in plan.trials() if t not in outcome.child_run_ids]
        if outcome.child_run_ids:
            _summarize(outcome, plan, echo)
        if not outcome.missing:
            _close(tracker, "FINISHED")
            return outcome
        if outcome.errors:
            outcome.status = "FAILED"
            failed = "; ".join(f"{a} seed {s}: {e}" for (a, s), e in outcome.errors.items())
            _close(tracker, "FAILED", f"{len(outcome.errors)} trial(s) failed: {failed}; run the "
                   "same command again to retry them")
        else:
            outcome.status = "KILLED"
            _close(tracker, "KILLED", "interrupted; run the same command again to resume")
        return outcome
