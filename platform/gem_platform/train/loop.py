"""The training loop of one rank. It runs in-process (``gemctl submit --local``: one process,
no Ray) or as a Ray Train worker; the same function serves both.

``train`` runs named stages: ``setup`` (data, model, parallelism, optimizers, batcher),
``resume`` (the latest checkpoint, if any), then for each batch of ``batch_stream``:
``launch_step``, ``settle`` and ``account``, ``log_step``, scheduled ``evaluate`` (on the
fixed held-out sample, ``scheduled_eval``) and ``save_checkpoint``; last, ``summarize`` (the
final evaluation, on train.eval_max_samples). Each evaluation extends the run's learning curve
and its warnings (gem_platform.train.learning). Progress lines and metrics leave through one
``Reporter``.

The host does not wait for a step's kernels before it launches the next one: a step is read
back (loss, gradient norm, timings; gem_platform.train.launched) once the next step's forward
is queued, or at once on a step that logs, evaluates or saves. A NaN therefore stops the run
when its step is read back, one forward later, with the same report.

How gradients are synchronized depends on the parallel strategy (gem_platform.parallel):
replicated parameters are averaged after backward (under plain data parallelism, one flat
all-reduce); HSDP-sharded parameters reduce-scatter their gradients inside backward;
TorchRec-sharded tables exchange lookups by all-to-all in forward and backward and update
inside backward through their fused optimizer.

A step is timed in two parts, on the device's timeline: the sync of replicated gradients,
and everything else (forward, backward, clipping, optimizer step). E2E MFU takes the step's
wall time (from one read-back to the next); Local MFU the second part alone. Under plain
data parallelism that part is compute alone, as GEM defines Local MFU; under HSDP, expert
parallelism or TorchRec sharding it also holds the collectives that run inside forward and
backward (and the grad-norm all-reduce), so Local MFU is then a lower bound of compute-alone
MFU and the scaling ratio an upper bound.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from gem_kernels.gdpa import tuning_seconds as gdpa_tuning_seconds
from gem_platform.balance import Batcher, LoaderConfig, make_batcher
from gem_platform.balance.cost import batch_work
from gem_platform.balance.stats import measure_step
from gem_platform.checkpoint.reshard import fit_schedule, layout_changes, map_loader
from gem_platform.checkpoint.store import Stateful
from gem_platform.data.batch import TASKS, JaggedBatch
from gem_platform.data.ceilings import BLIND_AUC_METRIC, blind_ceilings
from gem_platform.data.loader import Table, expected_work, iterate, open_table
from gem_platform.data.meta import DatasetMeta
from gem_platform.data.parquet import SampleTable
from gem_platform.data.prepare import prepare_dataset
from gem_platform.model import GemModel
from gem_platform.model.flops import FlopMeter
from gem_platform.parallel import Parallelized, parallelize
from gem_platform.parallel.fused_state import fill_fused_state
from gem_platform.progress import Echo, Event, StepProgress
from gem_platform.provenance import device_name
from gem_platform.recipe import Recipe, TrainConfig
from gem_platform.train.compile_cache import own_compile_cache
from gem_platform.train.compile_watch import CompileWatch
from gem_platform.train.determinism import deterministic_mode
from gem_platform.train.device_memory import explained_out_of_memory
from gem_platform.train.launched import LaunchedStep, StepClock, StepResult
from gem_platform.train.learning import TRAINED_EPOCHS
from gem_platform.train.learning_report import (
    epochs_line,
    eval_metrics,
    eval_point,
    eval_progress,
    precision_line,
    summary_entries,
    warning_line,
)
from gem_platform.train.metrics import TaskEvaluator
from gem_platform.train.mfu import Peak, mfu, resolve_peak
from gem_platform.train.optim import dense_optimizer
from gem_platform.train.prefetch import Prefetcher
from gem_platform.train.regions import (
    CheckpointPlan,
    batch_units,
    compile_backend,
    compile_enabled,
    setup_regions,
)
from gem_platform.train.saved_activations import (
    model_weight_shapes,
    saved_activations,
    stored_bytes,
)
from gem_platform.train.shared_grads import separate_shared_grads
from gem_platform.train.state import CheckpointExtras, LoopState, Totals

MetricSink = Callable[[dict[str, float], int], None]
# The run summary: metrics (floats) plus "peak_source", where the MFU peak came from, "device",
# what rank 0 trained on, and the learning curve and warnings (lists;
# gem_platform.train.learning_report).
RunSummary = dict[str, float | str | list]

# The cosine schedule ends at this fraction of the base learning rate, not at zero, so the last
# steps still move the weights (rarely seen embedding rows are updated late in a run too). The
# same floor holds for the dense and the sparse optimizer.
MIN_LR_FRACTION = 0.1
# A training step's forward and backward, as named in a profiler trace.
FORWARD, BACKWARD = "gem.forward", "gem.backward"


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls) -> RankInfo:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()


def pick_device(recipe: Recipe) -> torch.device:
    want = recipe.train.device
    if want == "auto":
        want = "cuda" if (recipe.parallel.use_gpu and torch.cuda.is_available()) else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but no CUDA device is visible to this worker")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compute_loss(logits: torch.Tensor, batch: JaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """CTR loss on every sample plus CVR loss on clicked samples; also the per-task losses."""
    logits = logits.float()
    ctr = F.binary_cross_entropy_with_logits(logits[:, 0], batch.labels[:, 0])
    mask = batch.cvr_mask.float()
    cvr_all = F.binary_cross_entropy_with_logits(logits[:, 1], batch.labels[:, 1],
                                                 reduction="none")
    cvr = (cvr_all * mask).sum() / mask.sum().clamp_min(1.0)
    return ctr + cvr, torch.stack([ctr.detach(), cvr.detach()])


def _common_steps_per_epoch(local_samples: int, batch_size: int, info: RankInfo) -> int:
    steps = torch.tensor([local_samples // batch_size], dtype=torch.int64)
    if info.distributed:
        dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    return int(steps.item())


def lr_factor(recipe: Recipe) -> Callable[[int], float]:
    """The LR multiplier after ``step`` scheduler steps: linear warm-up over
    ``train.warmup_steps``, then cosine decay from 1 to ``MIN_LR_FRACTION`` at
    ``train.steps`` (held there after)."""
    warm, total = recipe.train.warmup_steps, recipe.train.steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(total - warm, 1)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine

    return f


def planted_item_vectors(recipe: Recipe) -> torch.Tensor | None:
    """The synthetic world's item vectors, where model.item_vectors=planted asks for them."""
    if recipe.model.item_vectors != "planted":
        return None
    from gem_platform.data.synthetic import PlantedWorld

    vectors = torch.as_tensor(PlantedWorld.build(recipe.data.synthetic).item_vec)
    if vectors.shape[1] > recipe.model.d_model:
        raise ValueError(
            f"model.item_vectors=planted needs model.d_model >= {vectors.shape[1]} (the "
            f"planted vectors' size); it is {recipe.model.d_model}.")
    return vectors


def build_model(recipe: Recipe, meta: DatasetMeta, device: torch.device) -> nn.Module:
    torch.manual_seed(recipe.train.seed)
    model = GemModel(recipe.model, meta, planted_item_vectors(recipe))
    if recipe.precision.mode == "fp8_block":
        from gem_platform.precision.convert import convert_to_fp8

        p = recipe.precision
        convert_to_fp8(model, block=p.block, hadamard=p.hadamard, hadamard_block=p.hadamard_block,
                       stochastic_rounding=p.stochastic_rounding, wgrad=p.wgrad,
                       keep_last=p.keep_last_bf16, keep=p.keep_bf16,
                       min_features=p.min_features)
    return model.to(device)


def autocast_for(recipe: Recipe, device: torch.device):
    """The autocast context the recipe's precision trains and evaluates under (bf16 for bf16
    and fp8_block, none for fp32)."""
    if recipe.precision.mode in ("bf16", "fp8_block"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def _eval_batch_count(n: int, batch_size: int, info: RankInfo) -> int:
    """Eval batches every rank runs: the most any rank needs. Sharded tables, FSDP units and
    the expert exchange make the forward a collective, so a rank with fewer samples must
    still take part in every batch."""
    count = torch.tensor([math.ceil(n / batch_size)], dtype=torch.int64)
    if info.distributed:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


@torch.no_grad()
def evaluate(model: nn.Module, table: SampleTable, recipe: Recipe, device: torch.device,
             info: RankInfo, max_samples: int | None = None) -> dict[str, float]:
    """NE and AUC per task on this rank's share of the eval split, reduced over ranks.

    ``max_samples`` caps the samples scored (all ranks together, the first of each rank's
    share); default train.eval_max_samples. Every rank runs the same number of batches; past
    the end of its share a rank scores a one-sample stand-in batch that is masked out of every
    metric, so the result is exact."""
    model.eval()
    evaluators = {task: TaskEvaluator() for task in TASKS}
    n = len(table)
    cap = recipe.train.eval_max_samples if max_samples is None else max_samples
    if cap is not None:
        n = min(n, max(cap // info.world_size, 1))
    bs = recipe.loader.local_batch_size
    batches = _eval_batch_count(n, bs, info)
    if batches and n == 0:
        raise RuntimeError(
            f"rank {info.rank} holds no eval samples while other ranks do: the eval split is "
            f"smaller than parallel.workers={info.world_size}. Generate more eval samples "
            "(data.synthetic.eval_fraction) or run fewer workers.")
    for start in range(0, batches * bs, bs):
        indices = np.arange(start, min(start + bs, n))
        real = indices.size > 0
        batch = table.collate(indices if real else np.zeros(1, dtype=np.int64)).to(device)
        with autocast_for(recipe, device):
            logits = model(batch).float()
        keep = torch.full((batch.num_samples,), real, dtype=torch.bool, device=logits.device)
        evaluators["ctr"].update(logits[:, 0], batch.labels[:, 0], mask=keep)
        evaluators["cvr"].update(logits[:, 1], batch.labels[:, 1],
                                 mask=batch.cvr_mask & keep)
    model.train()
    out: dict[str, float] = {}
    for task, ev in evaluators.items():
        s = ev.compute()
        out[f"eval/ne_{task}"] = s.ne
        out[f"eval/auc_{task}"] = s.auc
        out[f"eval/logloss_{task}"] = s.log_loss
        out[f"eval/base_rate_{task}"] = s.base_rate
        out[f"eval/count_{task}"] = float(s.count)
        out[f"eval/calibration_{task}"] = s.calibration
        out[f"eval_se/ne_{task}"] = s.se_ne
        out[f"eval_se/auc_{task}"] = s.se_auc
    return out


class TrainingDiverged(RuntimeError):
    """The loss or a gradient became NaN/inf: the run stops (its last good checkpoint, if it
    saves any, is kept)."""


def _divergence_report(step: int, loss: torch.Tensor, logits: torch.Tensor,
                       model: nn.Module, checkpointing: bool) -> str:
    if not torch.isfinite(logits).all():
        culprit = "the model's logits"
    elif not torch.isfinite(loss):
        culprit = "the loss"
    else:
        bad = [n for n, p in model.named_parameters()
               if p.grad is not None and not torch.isfinite(p.grad).all()]
        culprit = f"the gradient of {bad[0]}" if bad else "the gradient norm"
    kept = ("the last good checkpoint is kept" if checkpointing else
            "no checkpoint was saved (checkpointing is off)")
    return (f"training diverged at step {step}: {culprit} became NaN/inf (loss "
            f"{float(loss.detach()):.4g}); {kept}")


class CheckpointStore(Protocol):
    """Where a run's checkpoints go: Ray Train's storage, or local folders."""

    every: int

    def latest(self) -> Path | None: ...

    def folder(self, step: int) -> Path: ...

    def commit(self, folder: Path, step: int, metrics: dict[str, float]) -> None: ...


@dataclass
class Reporter:
    """Where a rank's progress goes. Only rank 0 reports: ``echo`` takes progress events
    (gem_platform.progress: a StepProgress per logged step, an EvalProgress per evaluation,
    text for the rest),
    ``sink(metrics, step)`` step, eval and summary metrics (MLflow logging). Metrics of steps
    the run's record already holds (``step <= published_through``, replayed after a resume)
    are not sent again, so the record has no gap and no repeat."""

    chief: bool
    sink: MetricSink | None = None
    echo: Echo = print
    published_through: int = 0

    def line(self, event: Event) -> None:
        if self.chief:
            self.echo(event)

    def publish(self, metrics: dict[str, float], step: int) -> None:
        if self.chief and self.sink and step > self.published_through:
            self.sink(metrics, step)


@dataclass
class Run:
    """What ``setup`` builds for one rank: data, the parallelized model and its optimizers."""

    recipe: Recipe
    info: RankInfo
    device: torch.device
    meta: DatasetMeta
    train_table: Table  # streamed when loader.window_samples is set
    eval_table: SampleTable
    par: Parallelized
    optimizers: list[torch.optim.Optimizer]  # [dense (AdamW), sparse (tables)]
    schedules: list[torch.optim.lr_scheduler.LRScheduler]
    loader: LoaderConfig
    batcher: Batcher
    peak: Peak
    regions: CheckpointPlan = field(default_factory=CheckpointPlan)
    clock: StepClock = field(init=False)
    # the batcher's state as of the last batch handed to the loop (batches are collated ahead)
    loader_state: dict | None = None
    state: Stateful = field(init=False)

    def __post_init__(self) -> None:
        self.state = Stateful(self.par.model, self.optimizers,
                              self.recipe.parallel.model_dump(mode="json"), self.info.world_size)
        self.clock = StepClock(self.device)

    @property
    def model(self) -> nn.Module:
        return self.par.model


def _stored_bytes(recipe: Recipe, model: nn.Module) -> Callable[[torch.Tensor], int] | None:
    """How the activation budget counts a saved tensor: at its 8-bit size where
    train.saved_activations=fp8 stores it so, else (None) at its storage's bytes."""
    if recipe.train.saved_activations != "fp8":
        return None
    weights = model_weight_shapes(model)
    return lambda t: stored_bytes(t, weights)


def setup(recipe: Recipe, info: RankInfo, device: torch.device, meta: DatasetMeta) -> Run:
    """Load this rank's data (the dataset ``meta`` describes, already prepared), build and
    parallelize the model on ``device``, its optimizers, LR schedules and batcher (the same on
    every rank apart from its data)."""
    loader = recipe.loader_config()
    truncate = recipe.data.history_overflow == "truncate"
    train_table = open_table(recipe.data.path, "train", info.rank, info.world_size, loader,
                             truncate=truncate)
    eval_table = SampleTable.load(recipe.data.path, "eval", info.rank, info.world_size,
                                  truncate=truncate)

    par = parallelize(build_model(recipe, meta, device), recipe)
    dense_opt = dense_optimizer(par.dense_params, recipe.train, device)
    # Sharded tables (TorchRec) train with their fused optimizer; replicated ones with Adagrad.
    init = recipe.train.sparse_accumulator_init
    sparse_opt = par.sparse_optimizer or torch.optim.Adagrad(
        par.sparse_params, lr=recipe.train.sparse_lr, eps=recipe.train.sparse_eps,
        initial_accumulator_value=init)
    if par.sparse_optimizer is not None and init:
        fill_fused_state(par.sparse_optimizer, init)
    optimizers = [dense_opt, sparse_opt]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lr_factor(recipe)) for o in optimizers]

    steps_per_epoch = _common_steps_per_epoch(len(train_table), recipe.loader.local_batch_size,
                                              info)
    if steps_per_epoch == 0:
        raise RuntimeError(
            f"rank {info.rank} holds {len(train_table)} training samples, fewer than one local "
            f"batch of loader.local_batch_size={recipe.loader.local_batch_size}"
        )
    batcher = make_batcher(loader, train_table.seq_lengths, steps_per_epoch, rank=info.rank,
                           pieces=train_table.pieces, expected_work=expected_work(meta, loader))
    peak = resolve_peak(device, recipe.precision.mode, recipe.train.peak_tflops)
    # Compiled and recomputed regions (train.compile, train.activation_memory_gb).
    regions = setup_regions(
        par.model, compile=compile_enabled(recipe.train.compile, device),
        backend=compile_backend(recipe.train.compile_backend),
        budget_gb=recipe.train.activation_memory_gb,
        units=batch_units(train_table.seq_lengths, recipe.loader.local_batch_size),
        device=device, autocast=lambda: autocast_for(recipe, device),
        stored=_stored_bytes(recipe, par.model),
        compile_only=recipe.train.compile_regions)
    return Run(recipe, info, device, meta, train_table, eval_table, par, optimizers, schedules,
               loader, batcher, peak, regions)


def resume(run: Run, checkpoints: CheckpointStore | None, report: Reporter
           ) -> tuple[LoopState, int]:
    """The loop's state and the epoch to continue in: from the latest checkpoint of
    ``checkpoints`` (model, optimizers, RNG, batcher and schedules restored in place), or
    fresh (step 0, epoch 0)."""
    folder = checkpoints.latest() if checkpoints else None
    if folder is None:
        return LoopState(), 0
    extras = run.state.load(folder, run.info.rank)
    if not isinstance(extras, CheckpointExtras):
        raise RuntimeError(f"checkpoint {folder} was written by an earlier version of the "
                           "training loop and can't be resumed by this one: start a new run")
    saved = run.state.loaded_layout
    loader = map_loader(saved, extras.loader, run.batcher.state_dict(), run.info.world_size)
    run.batcher.load_state_dict(loader)
    for sched, sd in zip(run.schedules, extras.schedulers, strict=True):
        sched.load_state_dict(fit_schedule(sd, len(sched.optimizer.param_groups)))
    report.line(f"resumed from step {extras.loop.step} ({folder})")
    if saved is not None and (changes := layout_changes(saved, run.state.parallel,
                                                        run.info.world_size)):
        report.line(f"resharded the checkpoint to this layout ({', '.join(changes)})")
    return extras.loop, int(loader["epoch"])


def batch_stream(run: Run, start_epoch: int) -> Iterator[tuple[JaggedBatch, np.ndarray]]:
    """Training batches on the run's device, with their sample positions in the rank's table,
    epoch after epoch from ``start_epoch`` (continuing mid-epoch after a resume).

    With ``train.prefetch_batches`` > 0 batches are collated that many ahead on a background
    thread and copied to the GPU on a side stream (train.prefetch); ``run.loader_state`` keeps
    the batcher's state as of the batch handed out, which is what a checkpoint must resume."""
    def host() -> Iterator[tuple[JaggedBatch, tuple[np.ndarray, dict]]]:
        for batch, indices in iterate(run.train_table, run.batcher, start_epoch):
            yield batch, (indices, run.batcher.state_dict())

    depth = run.recipe.train.prefetch_batches
    if depth == 0:
        for batch, (indices, loader_state) in host():
            run.loader_state = loader_state
            yield batch.to(run.device), indices
        return
    with Prefetcher(host(), run.device, depth) as batches:
        for batch, (indices, loader_state) in batches:
            run.loader_state = loader_state
            yield batch, indices


def with_upcoming(run: Run, stream: Iterator[tuple[JaggedBatch, np.ndarray]]
                  ) -> Iterator[tuple[JaggedBatch, np.ndarray, JaggedBatch | None]]:
    """``stream``'s batches, each with the one after it (None at the end), for the sparse
    input pipeline; ``run.loader_state`` stays that of the batch handed out, not of the one
    looked ahead to (a checkpoint resumes after the batch it trained last)."""
    current = next(stream, None)
    state = run.loader_state
    while current is not None:
        upcoming = next(stream, None)
        state, run.loader_state = run.loader_state, state
        yield *current, (upcoming[0] if upcoming is not None else None)
        current = upcoming


def launch_step(run: Run, batch: JaggedBatch, step: int, meter: FlopMeter,
                before_backward: Callable[[], None] = lambda: None,
                upcoming: JaggedBatch | None = None) -> LaunchedStep:
    """Queue forward, backward, gradient sync, clip and optimizer step on one batch, without
    waiting for the device (gem_platform.train.launched); read it back with ``settle``.

    ``before_backward`` runs once the forward is queued: the loop settles the previous step
    there, while this step's forward keeps the device busy. That is also why the dense
    gradients are cleared only then: the previous step's gradients stay readable for its
    divergence report. Where the tables are sharded and pipelined, ``upcoming`` (the next
    batch) has its embedding input distribution started before this forward and advanced
    before this backward (gem_platform.parallel.sparse_pipeline)."""
    clock, par = run.clock, run.par
    dense, sparse = run.optimizers
    pipeline = par.sparse_pipeline
    launched_at = time.perf_counter()
    # Before the forward: TorchRec's fused optimizer hands its param groups' lr to the
    # kernel in zero_grad, and the lookup's forward captures it for the fused update.
    sparse.zero_grad(set_to_none=True)
    start = clock.mark()
    if pipeline is not None and upcoming is not None:
        pipeline.start(upcoming)
    distributed = (pipeline.forward_with(batch) if pipeline is not None
                   else contextlib.nullcontext())
    # train.saved_activations: what the forward keeps for the backward (fp8: compressed)
    with (saved_activations(run.recipe, run.model), meter, autocast_for(run.recipe, run.device),
          distributed, record_function(FORWARD)):
        logits = run.model(batch)
    loss, task_losses = compute_loss(logits, batch)
    before_backward()
    if pipeline is not None:
        pipeline.advance(upcoming)
    dense.zero_grad(set_to_none=True)
    with record_function(BACKWARD):
        loss.backward()
    # before any in-place update (sync, clip): a compiled backward may share one gradient
    separate_shared_grads(run.model.parameters())
    backward = clock.mark()
    par.sync_gradients()
    synced = clock.mark()
    # The norm is taken after the gradient sync, so every rank sees the same value and a
    # NaN anywhere stops all ranks at the same step.
    grad_norm = par.clip_grad_norm_(run.recipe.train.grad_clip or float("inf"))
    scalars = torch.cat([loss.detach().reshape(1), task_losses, grad_norm.reshape(1),
                         batch.labels[:, 0].sum().reshape(1)]).double()
    for opt in run.optimizers:
        opt.step()
    par.after_optimizer_step()
    for s in run.schedules:
        s.step()
    flops = meter.train_flops
    meter.reset()
    return LaunchedStep.queue(step, clock, (start, backward, synced), scalars, flops,
                              launched_at, logits, loss)


def settle(run: Run, launched: LaunchedStep, since: float,
           checkpointing: bool = False) -> StepResult:
    """Read a launched step back. Raises TrainingDiverged (on every rank at the same step)
    when its loss or synced gradient norm is not finite; the message says whether a
    checkpoint was kept (``checkpointing``: the run saves checkpoints)."""
    result = launched.settle(since)
    if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):
        raise TrainingDiverged(_divergence_report(result.step, launched.loss, launched.logits,
                                                  run.model, checkpointing))
    return result


def account(run: Run, state: LoopState, result: StepResult, num_samples: int,
            indices: np.ndarray, measured: bool) -> dict[str, float]:
    """Add the step to the loop's totals (to ``steady`` too when ``measured``: past the
    warm-up) and return its balance measures."""
    state.step = result.step
    state.last_loss = result.loss
    state.running.update(result.task_losses[0], result.positives, num_samples)
    state.since_eval.update(result.task_losses[0], result.positives, num_samples)
    seq = run.train_table.seq_lengths
    work = batch_work(seq, indices, run.loader.cost, run.loader.model_dim)
    step_balance = state.balance.record(measure_step(seq[indices], work))
    spans = (state.totals, state.window, state.steady) if measured else (state.totals,
                                                                       state.window)
    for acc in spans:
        acc.add(result.flops, result.compute_s, result.step_s,
                num_samples * run.info.world_size)
    return step_balance


@dataclass
class InFlight:
    """The step launched but not yet read back, and what accounting needs of its batch."""

    run: Run
    state: LoopState
    warm_until: int  # steps up to this one are warm-up, left out of QPS and MFU
    checkpointing: bool
    read_back: float = field(default_factory=time.perf_counter)  # host clock of the last
    launched: LaunchedStep | None = None
    samples: int = 0
    indices: np.ndarray | None = None

    def hold(self, launched: LaunchedStep, samples: int, indices: np.ndarray) -> None:
        self.launched, self.samples, self.indices = launched, samples, indices

    def settle(self) -> tuple[StepResult, dict[str, float]] | None:
        """Read back the step in flight, if any, and add it to the totals; returns it with
        its balance measures."""
        if self.launched is None:
            return None
        result = settle(self.run, self.launched, self.read_back, self.checkpointing)
        self.read_back = time.perf_counter()
        self.launched = None
        balance = account(self.run, self.state, result, self.samples, self.indices,
                          measured=result.step > self.warm_until)
        return result, balance

    def restart_clock(self) -> None:
        """Start the next step's wall time now (what happened since is not training)."""
        self.read_back = time.perf_counter()


def log_step(run: Run, state: LoopState, result: StepResult, step_balance: dict[str, float],
             report: Reporter) -> None:
    """Report the window since the last progress line (metrics and one line), then start a
    new window."""
    window, peak = state.window, run.peak
    metrics = {
        "train/loss": result.loss,
        "train/loss_ctr": result.task_losses[0],
        "train/loss_cvr": result.task_losses[1],
        "train/ne_ctr": state.running.pop(),
        "train/grad_norm": result.grad_norm,
        "perf/samples_per_s": window.samples / window.step_s,
        "perf/mfu_e2e": mfu(window.flops, window.step_s, peak),
        "perf/mfu_local": mfu(window.flops, window.compute_s, peak),
        "train/lr": run.schedules[0].get_last_lr()[0],
        **step_balance,
    }
    state.window = Totals()
    report.line(StepProgress(state.step, run.recipe.train.steps, result.loss,
                             metrics["train/ne_ctr"], metrics["perf/samples_per_s"],
                             step_balance["balance/straggler_overhead"]))
    report.publish(metrics, state.step)


def scheduled_eval_samples(recipe: Recipe) -> int:
    """Held-out samples a scheduled evaluation scores: train.eval_sample, within
    train.eval_max_samples."""
    cap = recipe.train.eval_max_samples
    return recipe.train.eval_sample if cap is None else min(recipe.train.eval_sample, cap)


def record_eval(run: Run, state: LoopState, scores: dict[str, float], report: Reporter
                ) -> dict[str, float]:
    """Add an evaluation at the current step to the run's learning curve: report its line and
    the warnings that start firing with it; return what it publishes (its scores included)."""
    point = eval_point(scores, TASKS, state.step, state.totals.samples, state.totals.step_s,
                       state.since_eval.pop())
    firing, new = state.curve.add(point)
    ceilings = run.meta.planted_auc
    report.line(eval_progress(point, run.recipe.train.steps, ceilings))
    for warning in new:
        report.line(warning_line(warning))
    return {**scores, **eval_metrics(point, firing, ceilings)}


def scheduled_eval(run: Run, state: LoopState, report: Reporter) -> None:
    """Collective: score the fixed held-out sample (the same samples every time), extend the
    learning curve and publish at the current step."""
    scores = evaluate(run.model, run.eval_table, run.recipe, run.device, run.info,
                      max_samples=scheduled_eval_samples(run.recipe))
    published = record_eval(run, state, scores, report)
    if len(state.curve.points) == 1 and (note := precision_line(state.curve.points[0])):
        report.line(note)
    report.publish(published, state.step)


def reached_target(state: LoopState, cfg: TrainConfig, report: Reporter) -> bool:
    """With train.stop_at_target: whether the evaluation just made reached train.target_ne
    (the same on every rank: evaluations are reduced over ranks), said in a line if so."""
    if not cfg.stop_at_target or cfg.target_ne is None or not state.curve.points:
        return False
    point = state.curve.points[-1]
    ne = point.tasks["ctr"].ne
    if not ne <= cfg.target_ne:  # NaN never reaches it
        return False
    report.line(f"step {state.step}: held-out ne_ctr {ne:.4f} reached train.target_ne "
                f"{cfg.target_ne}: training stops here (train.stop_at_target)")
    return True


def save_checkpoint(run: Run, state: LoopState, checkpoints: CheckpointStore) -> None:
    """Collective: write the model, optimizers and this rank's extras, and commit the folder."""
    folder = checkpoints.folder(state.step)
    extras = CheckpointExtras(loop=state, loader=run.loader_state or run.batcher.state_dict(),
                              schedulers=[s.state_dict() for s in run.schedules])
    run.state.save(folder, state.step, run.info.rank, extras)
    checkpoints.commit(folder, state.step, {"train/loss": state.last_loss,
                                            "step": float(state.step)})


def _memory(run: Run) -> dict[str, float]:
    """Peak device memory of the run (CUDA) and, under a recompute budget, the estimate of
    the activations kept."""
    out: dict[str, float] = {}
    if run.device.type == "cuda":
        out["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated(run.device) / 1e9
    if run.regions.budget_gb is not None:
        out["perf/activations_kept_gb"] = run.regions.kept_gb
    return out


def _truncated_histories(run: Run) -> float:
    """Histories cut to the dataset's max_seq_len (data.history_overflow: truncate), summed
    over the ranks' train and eval shares."""
    count = torch.tensor([run.train_table.truncated_rows + run.eval_table.truncated_rows],
                         dtype=torch.float64)
    if run.info.distributed:
        dist.all_reduce(count)
    return float(count.item())


def summarize(run: Run, state: LoopState, report: Reporter) -> RunSummary:
    """Final eval (the last point of the learning curve), the curve and its warnings, balance,
    throughput and MFU of the run (QPS and MFU over the steady steps)."""
    steady, totals, peak = state.steady, state.totals, run.peak
    e2e = mfu(steady.flops, steady.step_s, peak)
    local = mfu(steady.flops, steady.compute_s, peak)
    scores = evaluate(run.model, run.eval_table, run.recipe, run.device, run.info)
    summary: RunSummary = {
        **record_eval(run, state, scores, report),
        **state.balance.summary(),
        "perf/qps": steady.samples / steady.step_s if steady.step_s else float("nan"),
        "perf/qps_all_steps": totals.samples / totals.step_s if totals.step_s else float("nan"),
        "perf/steps_measured": float(steady.steps),
        "perf/compiles_after_warmup": float(state.compiles_after_warmup),
        "perf/mfu_e2e": e2e,
        "perf/mfu_local": local,
        "perf/scaling_ratio": e2e / local if local > 0 else float("nan"),
        "perf/train_flops_per_step": totals.flops / max(state.step, 1),
        "perf/peak_tflops": peak.tflops,
        "perf/world_size": float(run.info.world_size),
        "train/final_loss": state.last_loss,
        "train/steps": float(state.step),
        TRAINED_EPOCHS: state.step / max(len(run.batcher), 1),
        **_memory(run),
        "train/deterministic": float(run.recipe.train.deterministic),
        "data/truncated_histories": _truncated_histories(run),
    }
    if run.meta.planted_auc:
        for task, value in run.meta.planted_auc.items():
            summary[f"planted/auc_{task}"] = float(value)
    for task, value in blind_ceilings(run.meta.extra).items():
        summary[BLIND_AUC_METRIC.format(task=task)] = value
    summary.update(summary_entries(state.curve, totals.step_s, run.recipe.train.target_ne,
                                   run.meta.planted_auc))
    return summary


def train(recipe: Recipe, sink: MetricSink | None = None,
          echo: Echo = print,
          checkpoints: CheckpointStore | None = None,
          published_through: int = 0,
          on_step: Callable[[int, nn.Module], None] | None = None,
          meta: DatasetMeta | None = None) -> RunSummary:
    """Train per the recipe on this rank; returns the run summary (same on every rank).

    ``sink`` and ``echo`` receive metrics and progress events on rank 0 (see Reporter). With
    ``checkpoints``, the run resumes from the latest checkpoint and saves one every
    ``checkpoints.every`` steps. A resumed run replays the steps after its checkpoint;
    ``published_through`` (the last step the run's record already holds) keeps those from
    being published twice. ``on_step(step, model)`` runs after each training step is queued
    (a profiler's clock; the model's gradients are that step's until the next forward, once
    the device has finished it). With ``train.deterministic`` the run trains inside
    ``determinism.deterministic_mode(train.seed)``; the summary's ``train/deterministic`` says
    whether it did (1.0) or not (0.0), and Inductor's cache is the recipe's own
    (``compile_cache.own_compile_cache``). The device running out of memory raises
    ``DeviceMemoryError``, which names the recipe fields that lower the peak. ``meta``: the
    dataset as the run's driver prepared it (launch.submit prepares each dataset once per run
    and hands its meta to every rank); None prepares it here, for a run started in this
    process. The rank and its device are read once, here.
    """
    info, device = RankInfo.current(), pick_device(recipe)
    meta = meta if meta is not None else prepare_dataset(recipe.data)
    report = Reporter(info.is_chief, sink, echo, published_through)
    mode = (deterministic_mode(recipe.train.seed, device)
            if recipe.train.deterministic else contextlib.nullcontext())
    compiles = compile_enabled(recipe.train.compile, device)
    with mode, own_compile_cache(recipe, info.rank, compiles) as cache:
        if cache is not None:
            report.line(f"compile cache of this recipe: {cache}")
        with explained_out_of_memory(recipe, device, "while setting up the run"):
            run = setup(recipe, info, device, meta)
        plan = run.regions if run.regions.budget_gb is not None else None
        with explained_out_of_memory(recipe, device, "while training", plan):
            return _train(run, report, checkpoints, on_step)


def _train(run: Run, report: Reporter, checkpoints: CheckpointStore | None,
           on_step: Callable[[int, nn.Module], None] | None) -> RunSummary:
    """``train``'s stages, in order, on the rank ``setup`` made."""
    recipe = run.recipe
    if run.regions.budget_gb is not None:
        report.line(run.regions.describe())
    if (epochs := epochs_line(recipe.train.steps, len(run.batcher))) is not None:
        report.line(epochs)
    state, start_epoch = resume(run, checkpoints, report)
    cfg = recipe.train
    # QPS and MFU leave out each process's first steps: they pay kernel compilation and
    # autotuning (a first trial's QPS read up to 30% low with them counted).
    warm_until = state.step + min(cfg.perf_warmup_steps, cfg.steps - state.step - 1)
    meter = FlopMeter(run.model)
    steps = range(state.step + 1, cfg.steps + 1)
    checkpointing = bool(checkpoints and checkpoints.every)
    flight = InFlight(run, state, warm_until, checkpointing)
    eval_every = cfg.eval_interval()
    stream = batch_stream(run, start_epoch)
    batches = (with_upcoming(run, stream) if run.par.sparse_pipeline is not None
               else ((batch, indices, None) for batch, indices in stream))
    stop = False
    tuned_before = gdpa_tuning_seconds()
    with CompileWatch() as watch:
        for step, (batch, indices, upcoming) in zip(steps, batches, strict=False):
            # host lengths for the FLOP count (self-attention pairs), so it never waits on the GPU
            meter.seq_lengths = torch.as_tensor(run.train_table.seq_lengths[indices])
            flight.hold(launch_step(run, batch, step, meter, before_backward=flight.settle,
                                    upcoming=upcoming if step < cfg.steps else None),
                        batch.num_samples, indices)
            compiled = watch.take()
            if compiled and step > warm_until:
                state.compiles_after_warmup += compiled.count
                report.line(f"step {step}: {compiled.describe()} after the warm-up (in this "
                            "step's time, so in QPS and MFU)")
            logs = step % cfg.log_every == 0 or step == cfg.steps
            evals = bool(eval_every) and step % eval_every == 0 and step < cfg.steps
            saves = checkpointing and step % checkpoints.every == 0 and step < cfg.steps
            if logs or evals or saves:
                settled = flight.settle()  # the host needs this step's values now
                if logs and settled:
                    log_step(run, state, *settled, report)
                if evals:
                    scheduled_eval(run, state, report)
                    watch.take()  # eval-mode graphs compile outside any step's time
                    stop = reached_target(state, cfg, report)
                if saves:
                    save_checkpoint(run, state, checkpoints)
                flight.restart_clock()  # evaluation and saving are not the next step's time
            if on_step:
                on_step(step, run.model)
            if stop:
                break
        flight.settle()
        compiles = watch.totals().summary(gdpa_tuning_seconds() - tuned_before)

    metrics = {**summarize(run, state, report), **compiles}
    # the curve and warnings (lists) stay in the summary; the sink takes numbers
    report.publish({k: v for k, v in metrics.items() if isinstance(v, int | float)}, state.step)
    return {**metrics, "peak_source": run.peak.source, "device": device_name(run.device)}


__all__ = ["CheckpointStore", "MetricSink", "RankInfo", "Reporter", "Run", "RunSummary",
           "TrainingDiverged", "build_model", "compute_loss", "evaluate", "train"]
