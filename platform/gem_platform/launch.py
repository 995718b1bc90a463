"""Run a recipe: in-process, on an embedded local Ray, or on an existing Ray cluster.

The driver validates everything it can before any worker starts (data, world size, cluster,
tracking), opens the MLflow run, launches Ray Train (V2) workers that each call
:func:`gem_platform.train.loop.train`, and closes the run FINISHED or FAILED. The training
code (torch, TorchRec) is imported by the functions that train, so bad input fails fast.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gem_platform.data.meta import DatasetMeta
from gem_platform.errors import ClusterError, GemError, RecipeError
from gem_platform.interrupts import interrupt_in
from gem_platform.net import parse_url, require_reachable
from gem_platform.progress import Echo, Event, StepProgress, drain_while
from gem_platform.provenance import TAG_DEVICE
from gem_platform.recipe import Recipe
from gem_platform.topology import Placement
from gem_platform.topology.table_bounds import check_meta_tables
from gem_platform.tracking import (
    RunTracker,
    check_reachable,
    check_run_inputs,
    resolve_tracking_uri,
)

if TYPE_CHECKING:
    from gem_platform.checkpoint.intact import ResumePoint

log = logging.getLogger(__name__)
NO_CHECKPOINT = "no checkpoint of this run was found: it restarts from step 0"


class ResumeStopped(RuntimeError):
    """A resume failed before it trained a step: the run keeps the status it had."""


@dataclass
class _StepWatch:
    """``echo``, noting whether a training step has reported (a resume that stops before
    one leaves the run as it was)."""

    echo: Echo
    trained: bool = False

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepProgress):
            self.trained = True
        self.echo(event)


def _close_after(err: BaseException, stopped: bool, tracker: RunTracker,
                 watch: _StepWatch) -> str:
    """Close the run after ``err`` and return the reason: a resume of a closed run that
    trained no step gets the run's status back; otherwise FAILED, KILLED when ``stopped``
    (interrupted)."""
    reason = "interrupted" if stopped else f"{type(err).__name__}: {err}"
    if tracker.status_before not in (None, "RUNNING") and not watch.trained:
        tracker.restore_status(f"{reason} before a step trained")
    else:
        tracker.finish(ok=False, reason=reason, status="KILLED" if stopped else None)
    return reason


@dataclass
class RunOutcome:
    """A run that finished (a failed one raises instead): its MLflow id, tracking URI and the
    summary ``train`` returned."""

    run_id: str
    tracking_uri: str
    summary: dict[str, Any] = field(default_factory=dict)


def check_world_size(recipe: Recipe, meta: DatasetMeta, world: int) -> None:
    """Each rank needs at least one full local batch of training samples."""
    per_rank = meta.num_train // world
    if per_rank < recipe.loader.local_batch_size:
        raise RecipeError(
            f"parallel.workers={world} leaves {per_rank} training samples per rank, fewer than "
            f"loader.local_batch_size={recipe.loader.local_batch_size} ({meta.num_train} in "
            f"{recipe.data.path}).",
            "Use fewer workers, a smaller loader.local_batch_size, or more data.",
        )


# An embedded Ray runs every worker on this machine: beyond this many worker CPUs per core the
# workers (each a process holding torch and its share of the data) thrash or exhaust memory,
# and Ray would start them all before the first step says anything.
EMBEDDED_CPUS_PER_CORE = 4


def check_embedded_capacity(recipe: Recipe, cores: int | None = None) -> None:
    """Refuse a run an embedded local Ray can't host, before anything starts."""
    cores = cores or os.cpu_count() or 1
    need = recipe.parallel.workers * recipe.parallel.cpus_per_worker
    if need > EMBEDDED_CPUS_PER_CORE * cores:
        raise ClusterError(
            f"parallel.workers={recipe.parallel.workers} x parallel.cpus_per_worker="
            f"{recipe.parallel.cpus_per_worker} asks for {need} worker CPUs, and an embedded "
            f"local Ray runs them all on this machine's {cores} cores (at most "
            f"{EMBEDDED_CPUS_PER_CORE * cores}).",
            "Lower parallel.workers, or run on a Ray cluster with --address / RAY_ADDRESS.",
        )


def check_address(address: str, timeout: float = 3.0) -> None:
    """Fail in seconds when a cluster address can't be reached (Ray itself retries for long)."""
    if address in ("auto", "local"):
        return
    parsed = parse_url(address if "://" in address else f"gcs://{address}", "Ray address",
                       "Use ray://HEAD:10001, HEAD:6379 or 'auto'.", ClusterError)
    if parsed.scheme in ("http", "https"):
        # Jobs API addresses never reach a driver: `gemctl submit` sends those runs as Ray
        # jobs (gem_platform.remote) before calling submit() here.
        raise ClusterError(
            f"{address} is a Ray Jobs (dashboard) address; a training driver can't attach "
            "to it.",
            "Submit it as a Ray job: `gemctl submit RECIPE --address " + address + "` "
            "(gem_platform.remote.submit_job), or pass the cluster's client address "
            "(ray://HEAD:10001) or GCS address (HEAD:6379).",
        )
    host, port = parsed.hostname, parsed.port
    if not host or not port:
        raise ClusterError(f"Ray address {address!r} has no host:port.",
                           "Use ray://HEAD:10001, HEAD:6379 or 'auto'.")
    require_reachable(
        host, port, f"Ray cluster at {address}",
        "Check that the head node is running (`ray status` on it) and the address/port, or "
        "drop --address / RAY_ADDRESS to run on an embedded local Ray.", ClusterError, timeout)


def start_ray(address: str | None, cpus_needed: int) -> None:
    """Connect to the cluster at ``address``, or start a fresh embedded local Ray.

    Without an address Ray would join the last cluster ``ray start`` left on this machine
    (/tmp/ray/ray_current_cluster); an embedded run must not borrow someone's head node, so
    it asks for a new local instance explicitly.
    """
    import ray

    if address:
        check_address(address)
        ray.init(address=address, logging_level="WARNING")
    else:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, cpus_needed),
                 include_dashboard=False, logging_level="WARNING")


def _init_ray(recipe: Recipe, address: str | None) -> None:
    import ray

    if ray.is_initialized():
        return
    start_ray(address, recipe.parallel.workers * recipe.parallel.cpus_per_worker)
    have_cpu = ray.cluster_resources().get("CPU", 0)
    need_cpu = recipe.parallel.workers * recipe.parallel.cpus_per_worker
    if have_cpu < need_cpu:
        raise ClusterError(
            f"The Ray cluster has {have_cpu:g} CPUs; parallel.workers={recipe.parallel.workers} x "
            f"parallel.cpus_per_worker={recipe.parallel.cpus_per_worker} needs {need_cpu}.",
            "Lower parallel.workers / cpus_per_worker or add nodes.",
        )
    if recipe.parallel.use_gpu:
        have_gpu = ray.cluster_resources().get("GPU", 0)
        if have_gpu < recipe.parallel.workers:
            raise ClusterError(
                f"The Ray cluster has {have_gpu:g} GPUs; parallel.workers="
                f"{recipe.parallel.workers} with parallel.use_gpu needs one each.",
                "Lower parallel.workers, set parallel.use_gpu=false, or add GPU nodes.",
            )


def _ray_worker_loop(config: dict[str, Any]) -> None:
    """Body of each Ray Train worker: train, with rank 0 streaming progress to the driver."""
    import torch

    from gem_platform.checkpoint.store import RayStore
    from gem_platform.log_mask import mask_process_output
    from gem_platform.node_metrics import sampling_this_host
    from gem_platform.topology import worker_location
    from gem_platform.train.loop import RankInfo, TrainingDiverged, train

    mask_process_output()  # Ray writes its output to worker log files and to the driver
    recipe = Recipe.model_validate(config["recipe"])
    torch.set_num_threads(recipe.parallel.cpus_per_worker)
    info = RankInfo.current()
    tracker = RunTracker(config["tracking_uri"], config["run_id"]) if info.is_chief else None
    progress = config["progress"]

    def echo(event: Event) -> None:
        progress.put(("event", event))

    progress.put(("location", worker_location(info.rank, recipe.parallel.zone_label)))
    store = (RayStore(recipe.train.checkpoint_every, fallback=config.get("resume_from"))
             if recipe.train.checkpoint_every else None)
    try:
        with sampling_this_host(config.get("node_metrics"), info.rank, config["tracking_uri"],
                                config["run_id"], echo):
            summary = train(recipe, sink=tracker.log_metrics if tracker else None, echo=echo,
                            checkpoints=store, meta=config["meta"],
                            published_through=tracker.last_step() if tracker else 0)
    except TrainingDiverged as err:
        # Every rank stops at the same step; ending normally keeps Ray from retrying a run
        # that would diverge again from the same checkpoint.
        if info.is_chief:
            progress.put(("failed", str(err)))
        return
    if info.is_chief:
        progress.put(("summary", summary))


def ray_run_dir(recipe: Recipe, run_id: str) -> str:
    """Where Ray Train keeps this MLflow run's checkpoints (stable across resumes): a folder of
    ``train.storage`` (storage.py), an absolute local path or an object-store URI."""
    from gem_platform.storage import run_dir

    return run_dir(recipe, run_id)


def _run_on_ray(recipe: Recipe, meta: DatasetMeta, tracker: RunTracker, address: str | None,
                echo: Echo, resume: ResumePoint | None) -> dict[str, Any]:
    """Place ranks by topology (each host's ranks contiguous, each zone's hosts contiguous),
    pin every worker to its planned node, train, and check that Ray put them there."""
    from ray.util.queue import Queue

    from gem_platform.node_metrics import NodeMetricsPlan
    from gem_platform.storage import check_storage
    from gem_platform.topology import place_on_ray

    check_storage(recipe)
    _init_ray(recipe, address)
    placement = place_on_ray(recipe.parallel)
    tracker.log_json({"planned": [asdict(slot) for slot in placement.slots]}, "placement.json")
    node_metrics = NodeMetricsPlan.from_placement(placement)
    for key, host in node_metrics.tags().items():
        tracker.set_tag(key, host)
    progress = Queue(actor_options={"num_cpus": 0})
    if resume is not None and resume.folder is None:
        echo(NO_CHECKPOINT)
    trainer = _build_trainer(recipe, meta, tracker, placement, progress,
                             resume.folder if resume is not None else None, node_metrics)
    reports = _WorkerReports(echo)
    _fit_while_draining(trainer, progress, reports)
    return _check_and_record(reports, placement, tracker)


def recipe_for_workers(recipe: Recipe) -> Recipe:
    """The recipe as Ray Train workers read it: a relative local ``data.path`` made absolute
    from the driver's folder. Ray Train starts each worker in a run folder of its own, where
    the driver's relative path names nothing (the dataset was prepared from the driver's)."""
    from gem_platform.data.source import is_remote

    path = recipe.data.path
    if is_remote(path) or os.path.isabs(path):
        return recipe
    data = recipe.data.model_copy(update={"path": os.path.abspath(path)})
    return recipe.model_copy(update={"data": data})


def _build_trainer(recipe: Recipe, meta: DatasetMeta, tracker: RunTracker,
                   placement: Placement, progress: Any, resume_from: str | None = None,
                   node_metrics: Any = None) -> Any:
    """Ray Train's TorchTrainer for the run: one worker per rank pinned by ``placement``'s
    label selectors, checkpoints under ``ray_run_dir``. A resumed run continues from the
    latest checkpoint in that folder: Ray Train V2 restores a run whose name and storage
    already hold one (it refuses ``resume_from_checkpoint``); where that one is torn, the
    workers load ``resume_from`` (the newest intact one) instead. ``node_metrics`` (a
    NodeMetricsPlan) names the rank that samples each host's system metrics."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from gem_platform.storage import run_dir_name, storage_root
    from gem_platform.topology import label_selectors

    return TorchTrainer(
        train_loop_per_worker=_ray_worker_loop,
        train_loop_config={"recipe": recipe_for_workers(recipe).model_dump(mode="json"),
                           "meta": meta,
                           "run_id": tracker.run_id,
                           "tracking_uri": tracker.uri, "progress": progress,
                           "resume_from": resume_from, "node_metrics": node_metrics},
        torch_config=TorchConfig(backend=recipe.parallel.resolved_backend()),
        scaling_config=ScalingConfig(
            num_workers=recipe.parallel.workers, use_gpu=recipe.parallel.use_gpu,
            resources_per_worker={"CPU": recipe.parallel.cpus_per_worker},
            label_selector=label_selectors(placement),
        ),
        run_config=RunConfig(
            name=run_dir_name(recipe, tracker.run_id),
            storage_path=storage_root(recipe),
            failure_config=FailureConfig(max_failures=recipe.train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=recipe.train.keep_checkpoints),
        ),
    )


@dataclass
class _WorkerReports:
    """What the workers sent through the progress queue: progress events (echoed as they
    come), a divergence, each rank's location (the last report of a restarted rank wins) and
    rank 0's summary."""

    echo: Echo
    summary: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    locations: dict[int, Any] = field(default_factory=dict)

    def take(self, message: tuple[str, Any]) -> None:
        kind, payload = message
        if kind == "event":
            self.echo(payload)
        elif kind == "failed":
            self.failures.append(payload)
        elif kind == "location":
            self.locations[payload.rank] = payload
        else:
            self.summary.update(payload)


def _fit_while_draining(trainer: Any, progress: Any, reports: _WorkerReports) -> None:
    """Run ``trainer.fit()`` while the queue's messages go to ``reports``; re-raise what fit
    raised or the result's error."""
    result = drain_while(trainer.fit, progress, reports.take)
    if result.error is not None:
        raise result.error


def _check_and_record(reports: _WorkerReports, placement: Placement, tracker: RunTracker
                      ) -> dict[str, Any]:
    """Raise a worker's divergence, check where Ray put the ranks against the plan (and record
    both), and return rank 0's summary."""
    from gem_platform.topology import verify_placement
    from gem_platform.train.loop import TrainingDiverged

    if reports.failures:
        raise TrainingDiverged(reports.failures[0])
    verify_placement(placement, list(reports.locations.values()))
    tracker.log_json({"planned": [asdict(slot) for slot in placement.slots],
                      "actual": [asdict(loc) for loc in reports.locations.values()]},
                     "placement.json")
    if not reports.summary:
        raise RuntimeError("training finished without reporting its summary")
    return reports.summary


def _run_local(recipe: Recipe, meta: DatasetMeta, tracker: RunTracker, echo: Echo,
               resume: ResumePoint | None) -> dict[str, Any]:
    from gem_platform.checkpoint.store import LOCAL_ROOT, LocalStore
    from gem_platform.train.loop import train

    root = LOCAL_ROOT.resolve() / tracker.run_id
    if resume is None and root.exists():
        shutil.rmtree(root)
    store = None
    if recipe.train.checkpoint_every or resume is not None:
        store = LocalStore(root, recipe.train.checkpoint_every, recipe.train.keep_checkpoints,
                           start=resume)
        if resume is not None and resume.folder is None:
            echo(NO_CHECKPOINT)
    return train(recipe, sink=tracker.log_metrics, echo=echo, checkpoints=store, meta=meta,
                 published_through=tracker.last_step() if resume is not None else 0)


def resume_point(recipe: Recipe, run_id: str, local: bool) -> ResumePoint:
    """The checkpoint a resume of ``run_id`` loads, found before the run's record is touched:
    the newest intact one, with the newer torn ones it passes over. CheckpointError (bad
    input: the run's status stays as it was) when the run has checkpoints and none is
    intact."""
    from gem_platform.checkpoint.intact import CheckpointError, ResumePoint, find_resume_point
    from gem_platform.checkpoint.store import LOCAL_ROOT

    if not re.fullmatch(r"[A-Za-z0-9_-]+", run_id):
        return ResumePoint(run_id)  # not a run id: RunTracker.reopen refuses it
    root = str(LOCAL_ROOT.resolve() / run_id) if local else ray_run_dir(recipe, run_id)
    try:
        return find_resume_point(root)
    except CheckpointError as err:
        log.warning("resume refused: %s", err.problem)
        raise


def _layout_changes(recipe: Recipe, point: ResumePoint, world: int) -> list[str] | None:
    """How the resume's layout differs from its checkpoint's (None: the checkpoint does not
    record one); ReshardError (bad input, the run's record untouched) when it can't be
    resharded to this one."""
    from gem_platform.checkpoint.reshard import resume_changes

    return resume_changes(point.folder, recipe.parallel.model_dump(mode="json"), world)


def _note_resume(point: ResumePoint, tracker: RunTracker, echo: Echo,
                 changes: list[str] | None = None) -> None:
    """Say which checkpoints the resume passed over and why (and a legacy one's note), and
    what changed in the layout: in the output, the command's log and the run's record (an
    artifact per resume)."""
    resharded = ([f"layout changed since the checkpoint ({', '.join(changes)}): it is "
                  "resharded to this layout as it loads"] if changes else [])
    for line in [*point.skip_lines(), *point.notes(), *resharded]:
        echo(line)
        log.warning(line)
    if point.folder:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        tracker.log_text("\n".join([*point.lines(), *resharded]) + "\n", f"resume-{stamp}.log")


def _linear_reference(recipe: Recipe, meta: DatasetMeta, tracker: RunTracker,
                      echo: Echo) -> dict[str, float]:
    """The dataset's linear reference (reference/linear/*), logged beside the run's own
    held-out metrics; empty when it is neither cached nor quick to compute."""
    from gem_platform.reference.linear import summary_metrics

    metrics = summary_metrics(recipe.data.path, meta, echo)
    if metrics:
        tracker.log_metrics(metrics, step=recipe.train.steps)
    return metrics


def learning_tag(summary: dict[str, Any]) -> str:
    """The run's learning warnings (the summary's ``warn/*`` set to 1) as one tag value, e.g.
    ``memorization_ctr,ne_above_one_ctr``; ``none`` when none fired."""
    fired = sorted(key.removeprefix("warn/") for key, value in summary.items()
                   if key.startswith("warn/") and value == 1.0)
    return ",".join(fired) or "none"


def _prepared_and_checked(recipe: Recipe, local: bool, address: str | None
                          ) -> tuple[DatasetMeta, int]:
    """The run's dataset (prepared once: the ranks receive this meta) and its world size,
    once everything the store, the cluster or the data would refuse has been refused, before
    a run exists."""
    if address and not local:
        check_address(address)
    check_reachable(resolve_tracking_uri(recipe.tracking.uri))
    check_run_inputs(recipe.tracking.experiment, recipe.tracking.run_name, recipe.flat(),
                     recipe.tracking.tags)
    from gem_platform.data.prepare import prepare_dataset  # generator: torch, TorchRec

    meta = prepare_dataset(recipe.data)
    world = 1 if local else recipe.parallel.workers
    check_world_size(recipe, meta, world)
    if not local and not address:
        check_embedded_capacity(recipe)
    check_meta_tables(meta, recipe.model.d_model, recipe.model.sparse_dim,
                      f"{recipe.data.path}/meta.json")
    recipe.parallel.validate_against_world(world)
    if not local:
        recipe.parallel.check_host_split_trained()
    return meta, world


def submit(recipe: Recipe, *, local: bool = False, address: str | None = None,
           echo: Echo = print, resume: str | None = None) -> RunOutcome:
    """Validate, open the MLflow run, train, record the summary, close the run.

    GemError (bad input) raised before the run is opened leaves nothing behind; any failure
    after it marks the run FAILED with the reason (KILLED on Ctrl-C or SIGTERM), and is
    re-raised; a resume that fails before it trains a step gives the run back the status
    it had (ResumeStopped for a failure that is not bad input or an interrupt).

    ``resume`` (an MLflow run id) continues that run from its newest intact checkpoint,
    logging into the same run; the checkpoints are checked before the run's status changes,
    so a resume refused for torn checkpoints leaves a FINISHED run FINISHED.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    meta, world = _prepared_and_checked(recipe, local, address)
    uri = resolve_tracking_uri(recipe.tracking.uri)
    tags = {"gem.mode": "local" if local else "ray", "gem.recipe": recipe.name,
            "gem.data_source": meta.source,
            "gem.deterministic": str(recipe.train.deterministic).lower(),
            **recipe.tracking.tags}
    point, changes = None, None
    if resume:
        point = resume_point(recipe, resume, local)
        changes = _layout_changes(recipe, point, world)
        tracker = RunTracker.reopen(uri, resume, recipe.flat(), may_differ=[
            k for k in recipe.flat() if k.startswith("parallel.") and changes is not None])
    else:
        tracker = RunTracker.start(uri, recipe.tracking.experiment, recipe.tracking.run_name,
                                   recipe.flat(), tags)
    watch = _StepWatch(echo)
    echo = watch
    try:
        if not resume:
            tracker.log_text(recipe.to_yaml(), "recipe.yaml")
            if local:
                tracker.log_json({"mode": "local", "workers": 1}, "placement.json")
        if point is not None:
            _note_resume(point, tracker, echo, changes)
        if local:
            summary = _run_local(recipe, meta, tracker, echo, resume=point)
        else:
            summary = _run_on_ray(recipe, meta, tracker, address, echo, resume=point)
        summary.update(_linear_reference(recipe, meta, tracker, echo))
        tracker.log_json(summary, "summary.json")
        tracker.set_tag("gem.learning_warnings", learning_tag(summary))
        if isinstance(summary.get("device"), str):
            tracker.set_tag(TAG_DEVICE, summary["device"])
        tracker.finish(ok=True)
        return RunOutcome(tracker.run_id, uri, summary)
    except BaseException as err:
        # An interrupt that cleanup code replaced by its own error is still an interrupt.
        interrupt = interrupt_in(err)
        try:
            reason = _close_after(err, interrupt is not None, tracker, watch)
        finally:
            if interrupt is not None:
                raise interrupt  # the interrupt, not a failure to close the run
            if isinstance(err, GemError):
                raise
        if tracker.status_before not in (None, "RUNNING") and not watch.trained:
            raise ResumeStopped(f"resume of run {tracker.run_id} stopped before a step "
                                f"trained: {reason}") from err
        raise RuntimeError(f"run {tracker.run_id} failed: {reason}") from err
