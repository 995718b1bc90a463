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

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gem_platform.balance.cost import batch_work
from gem_platform.balance.stats import BalanceTracker, measure_step
from gem_platform.data.batch import TASKS, JaggedBatch
from gem_platform.data.meta import DatasetMeta
from gem_platform.data.parquet import SampleTable
from gem_platform.model import GemModel
from gem_platform.model.flops import FlopMeter
from gem_platform.parallel import parallelize
from gem_platform.recipe import Recipe
from gem_platform.train.metrics import TaskEvaluator
from gem_platform.train.mfu import Peak, mfu, resolve_peak

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


def _batches(table: SampleTable, recipe: Recipe, steps_per_epoch: int,
             device: torch.device) -> Iterator[tuple[JaggedBatch, np.ndarray]]:
    from gem_platform.balance import make_batcher

    batcher = make_batcher(recipe.loader, table.seq_lengths, steps_per_epoch=steps_per_epoch)
    epoch = 0
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
                       keep_last=p.keep_last_bf16, keep=p.keep_bf16)
    return model.to(device)


def _autocast(recipe: Recipe, device: torch.device):
    if recipe.precision.mode in ("bf16", "fp8_block"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


@torch.no_grad()
def evaluate(model: nn.Module, table: SampleTable, recipe: Recipe, device: torch.device,
             info: RankInfo) -> dict[str, float]:
    """NE and AUC per task on this rank's share of the eval split, reduced over ranks."""
    model.eval()
    evaluators = {task: TaskEvaluator() for task in TASKS}
    n = len(table)
    if recipe.train.eval_max_samples is not None:
        n = min(n, max(recipe.train.eval_max_samples // info.world_size, 1))
    bs = recipe.loader.local_batch_size
    for start in range(0, n, bs):
        batch = table.collate(np.arange(start, min(start + bs, n))).to(device)
        with _autocast(recipe, device):
            logits = model(batch).float()
        evaluators["ctr"].update(logits[:, 0], batch.labels[:, 0])
        evaluators["cvr"].update(logits[:, 1], batch.labels[:, 1], mask=batch.cvr_mask)
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


def train(recipe: Recipe, sink: MetricSink | None = None,
          echo: Callable[[str], None] = print) -> dict[str, float]:
    """Train per the recipe on this rank; returns the run summary (same on every rank).

    ``sink(metrics, step)`` receives step and eval metrics on rank 0 (MLflow logging);
    ``echo`` prints the progress lines on rank 0.
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
    sparse_opt = torch.optim.Adagrad(sparse_params, lr=recipe.train.sparse_lr)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, _lr_lambda(recipe))
                 for o in (dense_opt, sparse_opt)]

    steps_per_epoch = _common_steps_per_epoch(len(train_table), recipe.loader.local_batch_size,
                                              info)
    if steps_per_epoch == 0:
        raise RuntimeError(
            f"rank {info.rank} holds {len(train_table)} training samples, fewer than one local "
            f"batch of loader.local_batch_size={recipe.loader.local_batch_size}"
        )
    batches = _batches(train_table, recipe, steps_per_epoch, device)
    peak = resolve_peak(device, recipe.precision.mode, recipe.train.peak_tflops)
    balance = BalanceTracker()
    running = RunningNE()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    totals = {"flops": 0.0, "compute_s": 0.0, "step_s": 0.0, "samples": 0.0}
    window = {"flops": 0.0, "compute_s": 0.0, "step_s": 0.0, "samples": 0.0}
    meter = FlopMeter(model)
    last_loss = float("nan")
    for step in range(1, recipe.train.steps + 1):
        batch, indices = next(batches)
        sync()
        t0 = time.perf_counter()
        with meter, _autocast(recipe, device):
            logits = model(batch)
        loss, task_losses = compute_loss(logits, batch)
        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        loss.backward()
        sync()
        t_compute = time.perf_counter() - t0
        t1 = time.perf_counter()
        par.sync_gradients()
        sync()
        t_comm = time.perf_counter() - t1
        t2 = time.perf_counter()
        if recipe.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(dense_params, recipe.train.grad_clip)
        dense_opt.step()
        sparse_opt.step()
        for s in schedules:
            s.step()
        sync()
        t_compute += time.perf_counter() - t2
        step_s = time.perf_counter() - t0

        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss became {loss.item()} at step {step}")
        last_loss = float(loss)
        running.update(float(task_losses[0]), batch.labels)
        flops = meter.train_flops
        meter.reset()
        work = batch_work(train_table.seq_lengths, indices, recipe.loader.cost,
                          recipe.model.d_model)
        step_balance = balance.record(
            measure_step(train_table.seq_lengths[indices], work))
        for acc in (totals, window):
            acc["flops"] += flops
            acc["compute_s"] += t_compute
            acc["step_s"] += step_s
            acc["samples"] += batch.num_samples * info.world_size
        del t_comm

        if step % recipe.train.log_every == 0 or step == recipe.train.steps:
            metrics = {
                "train/loss": last_loss,
                "train/loss_ctr": float(task_losses[0]),
                "train/loss_cvr": float(task_losses[1]),
                "train/ne_ctr": running.pop(),
                "perf/samples_per_s": window["samples"] / window["step_s"],
                "perf/mfu_e2e": mfu(window["flops"], window["step_s"], peak),
                "perf/mfu_local": mfu(window["flops"], window["compute_s"], peak),
                "train/lr": schedules[0].get_last_lr()[0],
                **step_balance,
            }
            for acc_key in window:
                window[acc_key] = 0.0
            if info.is_chief:
                echo(f"step {step:>5}/{recipe.train.steps}  loss {metrics['train/loss']:.4f}  "
                     f"ne_ctr {metrics['train/ne_ctr']:.4f}  "
                     f"samples/s {metrics['perf/samples_per_s']:.0f}  "
                     f"straggler {step_balance['balance/straggler_overhead']:.1%}")
                if sink:
                    sink(metrics, step)
        if (recipe.train.eval_every and step % recipe.train.eval_every == 0
                and step < recipe.train.steps):
            ev = evaluate(model, eval_table, recipe, device, info)
            if info.is_chief and sink:
                sink(ev, step)

    ev = evaluate(model, eval_table, recipe, device, info)
    e2e = mfu(totals["flops"], totals["step_s"], peak)
    local = mfu(totals["flops"], totals["compute_s"], peak)
    summary = {
        **ev,
        **balance.summary(),
        "perf/qps": totals["samples"] / totals["step_s"],
        "perf/mfu_e2e": e2e,
        "perf/mfu_local": local,
        "perf/scaling_ratio": e2e / local if local > 0 else float("nan"),
        "perf/train_flops_per_step": totals["flops"] / recipe.train.steps,
        "perf/peak_tflops": peak.tflops,
        "perf/world_size": float(info.world_size),
        "train/final_loss": last_loss,
        "train/steps": float(recipe.train.steps),
    }
    if meta.planted_auc:
        for task, value in meta.planted_auc.items():
            summary[f"planted/auc_{task}"] = float(value)
    if info.is_chief and sink:
        sink(summary, recipe.train.steps)
    summary["peak_source"] = peak.source  # type: ignore[assignment]
    return summary


__all__ = ["Peak", "RankInfo", "train", "evaluate", "build_model", "compute_loss"]
