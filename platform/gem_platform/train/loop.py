"""The training loop of one rank. It runs in-process (``gemctl submit --local``: one process,
no Ray) or as a Ray Train worker; the same function serves both.

Data parallelism here is explicit: after the backward pass the gradients of all parameters are
all-reduced in one flat bucket. Timing compute and communication separately gives Local MFU
(compute alone) beside E2E MFU (the whole step), as GEM defines them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gem_platform.balance import Batcher, make_batcher
from gem_platform.balance.cost import batch_work
from gem_platform.balance.stats import BalanceTracker, measure_step
from gem_platform.data.batch import TASKS, JaggedBatch
from gem_platform.data.meta import DatasetMeta
from gem_platform.data.parquet import SampleTable
from gem_platform.model import GemModel
from gem_platform.model.flops import FlopMeter
from gem_platform.parallel import parallelize
from gem_platform.recipe import Recipe
from gem_platform.train.checkpoint import Stateful
from gem_platform.train.metrics import TaskEvaluator
from gem_platform.train.mfu import mfu, resolve_peak

MetricSink = Callable[[dict[str, float], int], None]


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


def _batches(table: SampleTable, batcher: Batcher, start_epoch: int, device: torch.device
             ) -> Iterator[tuple[JaggedBatch, np.ndarray]]:
    epoch = start_epoch
    while True:
        for indices in batcher.epoch(epoch):
            yield table.collate(indices).to(device), indices
        epoch += 1


def _lr_lambda(recipe: Recipe) -> Callable[[int], float]:
    warm, total = recipe.train.warmup_steps, recipe.train.steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(total - warm, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f


def build_model(recipe: Recipe, meta: DatasetMeta, device: torch.device) -> nn.Module:
    torch.manual_seed(recipe.train.seed)
    model = GemModel(recipe.model, meta)
    if recipe.precision.mode == "fp8_block":
        from gem_platform.precision.convert import convert_to_fp8

        p = recipe.precision
        convert_to_fp8(model, block=p.block, hadamard=p.hadamard, hadamard_block=p.hadamard_block,
                       stochastic_rounding=p.stochastic_rounding, wgrad=p.wgrad,
                       keep_last=p.keep_last_bf16, keep=p.keep_bf16,
                       min_features=p.min_features)
    return model.to(device)


def _autocast(recipe: Recipe, device: torch.device):
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
             info: RankInfo) -> dict[str, float]:
    """NE and AUC per task on this rank's share of the eval split, reduced over ranks.

    Every rank runs the same number of batches; past the end of its share a rank scores a
    one-sample stand-in batch that is masked out of every metric, so the result is exact."""
    model.eval()
    evaluators = {task: TaskEvaluator() for task in TASKS}
    n = len(table)
    if recipe.train.eval_max_samples is not None:
        n = min(n, max(recipe.train.eval_max_samples // info.world_size, 1))
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
        with _autocast(recipe, device):
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
    return out


class RunningNE:
    """Train-time NE over the samples since the last report (the progress line's NE)."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.pos = 0.0
        self.count = 0

    def update(self, ctr_loss: float, labels: torch.Tensor) -> None:
        n = labels.shape[0]
        self.loss += ctr_loss * n
        self.pos += float(labels[:, 0].sum())
        self.count += n

    def pop(self) -> float:
        from gem_platform.train.metrics import normalized_entropy

        value = normalized_entropy(self.loss / max(self.count, 1), self.pos / max(self.count, 1))
        self.__init__()
        return value


class TrainingDiverged(RuntimeError):
    """The loss or a gradient became NaN/inf: the run stops, keeping its last good checkpoint."""


def _divergence_report(step: int, loss: torch.Tensor, logits: torch.Tensor,
                       model: nn.Module) -> str:
    if not torch.isfinite(logits).all():
        culprit = "the model's logits"
    elif not torch.isfinite(loss):
        culprit = "the loss"
    else:
        bad = [n for n, p in model.named_parameters()
               if p.grad is not None and not torch.isfinite(p.grad).all()]
        culprit = f"the gradient of {bad[0]}" if bad else "the gradient norm"
    return (f"training diverged at step {step}: {culprit} became NaN/inf (loss "
            f"{float(loss.detach()):.4g}); the last good checkpoint is kept")


class CheckpointStore(Protocol):
    """Where a run's checkpoints go: Ray Train's storage, or local folders."""

    every: int

    def latest(self) -> Path | None: ...

    def folder(self, step: int) -> Path: ...

    def commit(self, folder: Path, step: int, metrics: dict[str, float]) -> None: ...


@dataclass
class _Totals:
    flops: float = 0.0
    compute_s: float = 0.0
    step_s: float = 0.0
    samples: float = 0.0
    steps: int = 0

    def add(self, flops: float, compute_s: float, step_s: float, samples: float) -> None:
        self.flops += flops
        self.compute_s += compute_s
        self.step_s += step_s
        self.samples += samples
        self.steps += 1


def train(recipe: Recipe, sink: MetricSink | None = None,
          echo: Callable[[str], None] = print,
          checkpoints: CheckpointStore | None = None,
          published_through: int = 0,
          on_step: Callable[[int], None] | None = None) -> dict[str, float]:
    """Train per the recipe on this rank; returns the run summary (same on every rank).

    ``sink(metrics, step)`` receives step and eval metrics on rank 0 (MLflow logging);
    ``echo`` prints the progress lines on rank 0. With ``checkpoints``, the run resumes from
    the latest checkpoint and saves one every ``checkpoints.every`` steps. A resumed run
    replays the steps after its checkpoint; ``published_through`` (the last step the run's
    record already holds) keeps those from being published twice, so the record has no gap
    and no repeat. ``on_step(step)`` runs after each training step (a profiler's clock).
    """
    info = RankInfo.current()
    device = pick_device(recipe)
    meta = recipe.data.prepare()
    train_table = SampleTable.load(recipe.data.path, "train", info.rank, info.world_size)
    eval_table = SampleTable.load(recipe.data.path, "eval", info.rank, info.world_size)

    par = parallelize(build_model(recipe, meta, device), recipe)
    model, dense_params, sparse_params = par.model, par.dense_params, par.sparse_params
    dense_opt = torch.optim.AdamW(dense_params, lr=recipe.train.lr,
                                  weight_decay=recipe.train.weight_decay)
    # Sharded tables (TorchRec) train with their fused optimizer; replicated ones with Adagrad.
    sparse_opt = par.sparse_optimizer or torch.optim.Adagrad(sparse_params,
                                                             lr=recipe.train.sparse_lr)
    optimizers = [dense_opt, sparse_opt]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, _lr_lambda(recipe)) for o in optimizers]

    steps_per_epoch = _common_steps_per_epoch(len(train_table), recipe.loader.local_batch_size,
                                              info)
    if steps_per_epoch == 0:
        raise RuntimeError(
            f"rank {info.rank} holds {len(train_table)} training samples, fewer than one local "
            f"batch of loader.local_batch_size={recipe.loader.local_batch_size}"
        )
    loader_cfg = recipe.loader_config()
    batcher = make_batcher(loader_cfg, train_table.seq_lengths, steps_per_epoch, rank=info.rank)
    peak = resolve_peak(device, recipe.precision.mode, recipe.train.peak_tflops)
    balance = BalanceTracker()
    running = RunningNE()
    # totals: every step; steady: the steps after each process's warm-up, which pays kernel
    # compilation and autotuning (a first trial's QPS read up to 30% low with them counted)
    totals, window, steady = _Totals(), _Totals(), _Totals()
    last_loss = float("nan")
    start_step, start_epoch = 0, 0
    state = Stateful(model, optimizers)

    resume_from = checkpoints.latest() if checkpoints else None
    if resume_from is not None:
        extras = state.load(resume_from, info.rank)
        batcher.load_state_dict(extras["loader"])
        for sched, sd in zip(schedules, extras["schedulers"], strict=True):
            sched.load_state_dict(sd)
        totals, window = extras["totals"], extras["window"]
        steady = extras.get("steady", _Totals())
        balance, running = extras["balance"], extras["running"]
        last_loss, start_step = extras["last_loss"], extras["step"]
        start_epoch = extras["loader"]["epoch"]
        if info.is_chief:
            echo(f"resumed from step {start_step} ({resume_from})")

    def publish(metrics: dict[str, float], step: int) -> None:
        if info.is_chief and sink and step > published_through:
            sink(metrics, step)

    warm_until = start_step + min(recipe.train.perf_warmup_steps,
                                  recipe.train.steps - start_step - 1)
    batches = _batches(train_table, batcher, start_epoch, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    meter = FlopMeter(model)
    for step in range(start_step + 1, recipe.train.steps + 1):
        batch, indices = next(batches)
        # Before the forward: TorchRec's fused optimizer hands its param groups' lr to the
        # kernel in zero_grad, and the lookup's forward captures it for the fused update.
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        with meter, _autocast(recipe, device):
            logits = model(batch)
        loss, task_losses = compute_loss(logits, batch)
        loss.backward()
        sync()
        t_compute = time.perf_counter() - t0
        par.sync_gradients()
        sync()
        t2 = time.perf_counter()
        # The norm is taken after the gradient sync, so every rank sees the same value and a
        # NaN anywhere stops all ranks at the same step.
        grad_norm = par.clip_grad_norm_(recipe.train.grad_clip or float("inf"))
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            raise TrainingDiverged(_divergence_report(step, loss, logits, model))
        for opt in optimizers:
            opt.step()
        par.after_optimizer_step()
        for s in schedules:
            s.step()
        sync()
        t_compute += time.perf_counter() - t2
        step_s = time.perf_counter() - t0

        last_loss = float(loss.detach())
        running.update(float(task_losses[0]), batch.labels)
        flops = meter.train_flops
        meter.reset()
        work = batch_work(train_table.seq_lengths, indices, loader_cfg.cost, loader_cfg.model_dim)
        step_balance = balance.record(measure_step(train_table.seq_lengths[indices], work))
        for acc in (totals, window, steady) if step > warm_until else (totals, window):
            acc.add(flops, t_compute, step_s, batch.num_samples * info.world_size)

        if step % recipe.train.log_every == 0 or step == recipe.train.steps:
            metrics = {
                "train/loss": last_loss,
                "train/loss_ctr": float(task_losses[0]),
                "train/loss_cvr": float(task_losses[1]),
                "train/ne_ctr": running.pop(),
                "train/grad_norm": float(grad_norm),
                "perf/samples_per_s": window.samples / window.step_s,
                "perf/mfu_e2e": mfu(window.flops, window.step_s, peak),
                "perf/mfu_local": mfu(window.flops, window.compute_s, peak),
                "train/lr": schedules[0].get_last_lr()[0],
                **step_balance,
            }
            window = _Totals()
            if info.is_chief:
                echo(f"step {step:>5}/{recipe.train.steps}  loss {last_loss:.4f}  "
                     f"ne_ctr {metrics['train/ne_ctr']:.4f}  "
                     f"samples/s {metrics['perf/samples_per_s']:.0f}  "
                     f"straggler {step_balance['balance/straggler_overhead']:.1%}")
            publish(metrics, step)
        if (recipe.train.eval_every and step % recipe.train.eval_every == 0
                and step < recipe.train.steps):
            publish(evaluate(model, eval_table, recipe, device, info), step)
        if checkpoints and checkpoints.every and step % checkpoints.every == 0 \
                and step < recipe.train.steps:
            folder = checkpoints.folder(step)
            state.save(folder, step, info.rank, {
                "loader": batcher.state_dict(),
                "schedulers": [s.state_dict() for s in schedules],
                "totals": totals, "window": window, "steady": steady, "balance": balance,
                "running": running,
                "last_loss": last_loss, "step": step,
            })
            checkpoints.commit(folder, step, {"train/loss": last_loss, "step": float(step)})
        if on_step:
            on_step(step)

    ev = evaluate(model, eval_table, recipe, device, info)
    e2e = mfu(steady.flops, steady.step_s, peak)
    local = mfu(steady.flops, steady.compute_s, peak)
    summary = {
        **ev,
        **balance.summary(),
        "perf/qps": steady.samples / steady.step_s if steady.step_s else float("nan"),
        "perf/qps_all_steps": totals.samples / totals.step_s if totals.step_s else float("nan"),
        "perf/steps_measured": float(steady.steps),
        "perf/mfu_e2e": e2e,
        "perf/mfu_local": local,
        "perf/scaling_ratio": e2e / local if local > 0 else float("nan"),
        "perf/train_flops_per_step": totals.flops / recipe.train.steps,
        "perf/peak_tflops": peak.tflops,
        "perf/world_size": float(info.world_size),
        "train/final_loss": last_loss,
        "train/steps": float(recipe.train.steps),
    }
    if meta.planted_auc:
        for task, value in meta.planted_auc.items():
            summary[f"planted/auc_{task}"] = float(value)
    publish(summary, recipe.train.steps)
    summary["peak_source"] = peak.source  # type: ignore[assignment]
    return summary


__all__ = ["CheckpointStore", "RankInfo", "TrainingDiverged", "build_model", "compute_loss",
           "evaluate", "train"]
