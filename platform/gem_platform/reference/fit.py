"""The linear reference's model and training: one logistic regression per task (CTR on every
sample, CVR on clicked ones) over the same hand-made features, trained on CPU by streaming
the train split in chunks, and scored on the eval split with the run's own metrics."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gem_platform.data.arrays import SampleArrays
from gem_platform.data.batch import TASKS
from gem_platform.data.meta import DatasetMeta
from gem_platform.reference.chunks import iter_chunks
from gem_platform.reference.config import LinearReferenceConfig
from gem_platform.reference.features import Bags, DenseScale, FeatureLayout, encode
from gem_platform.train.metrics import TaskEvaluator, TaskScores


class _BagSum(torch.autograd.Function):
    """Weighted bag sums (``F.embedding_bag``, mode sum) whose weight gradient is one
    ``index_add_`` over the bags' entries: embedding_bag's own CPU backward sorts every
    entry of every step first."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, bags: TorchBags) -> torch.Tensor:
        ctx.bags, ctx.rows = bags, weight.shape[0]
        return F.embedding_bag(bags.indices, weight, bags.offsets, mode="sum",
                               per_sample_weights=bags.weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        bags = ctx.bags
        per_entry = bags.weights[:, None] * grad[bags.owner]
        out = torch.zeros(ctx.rows, grad.shape[1], dtype=grad.dtype)
        return out.index_add_(0, bags.indices, per_entry), None


class LinearModel(nn.Module):
    """Logits of every task: a bias plus the weighted sum of the sample's feature weights.
    Each task has its own weights (so its own L2 strength); they share only the inputs."""

    def __init__(self, num_features: int, base_rates: tuple[float, ...]) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.zeros(num_features, 1)) for _ in base_rates)
        rates = torch.tensor(base_rates, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
        self.bias = nn.Parameter(torch.log(rates / (1 - rates)).float())

    def forward(self, bags: TorchBags) -> torch.Tensor:
        logits = [_BagSum.apply(weight, bags) for weight in self.weights]
        return torch.cat(logits, dim=1) + self.bias


@dataclass
class TorchBags:
    """A slice of :class:`Bags` as tensors (offsets without the closing entry)."""

    indices: torch.Tensor
    weights: torch.Tensor
    offsets: torch.Tensor
    owner: torch.Tensor  # the sample of every entry

    @classmethod
    def of(cls, bags: Bags, start: int, stop: int) -> TorchBags:
        a, b = int(bags.offsets[start]), int(bags.offsets[stop])
        indices = torch.from_numpy(bags.indices[a:b])
        offsets = torch.from_numpy(bags.offsets[start:stop + 1] - a)
        owner = torch.repeat_interleave(torch.arange(stop - start), offsets.diff())
        return cls(indices, torch.from_numpy(bags.weights[a:b]),
                   offsets[:-1].to(indices.dtype), owner)  # embedding_bag: one index type


@dataclass
class FitOutcome:
    """The reference's held-out scores per task and how it was trained."""

    scores: dict[str, TaskScores]
    train_samples: int
    num_features: int


def _labels(arrays: SampleArrays) -> torch.Tensor:
    return torch.from_numpy(np.stack([arrays.ctr, arrays.cvr], axis=1).astype(np.float32))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean CTR log loss plus mean CVR log loss over the clicked samples."""
    loss = F.binary_cross_entropy_with_logits(logits[:, 0], labels[:, 0])
    clicked = labels[:, 0] > 0.5
    if clicked.any():
        loss = loss + F.binary_cross_entropy_with_logits(logits[clicked, 1], labels[clicked, 1])
    return loss


@dataclass
class _Encoded:
    """One chunk of training samples, featurized."""

    bags: Bags
    labels: torch.Tensor

    @property
    def nbytes(self) -> int:
        b = self.bags
        return b.indices.nbytes + b.weights.nbytes + b.offsets.nbytes + self.labels.nbytes


class _TrainChunks:
    """The train split as featurized chunks, in a new order every epoch.

    The first epoch streams the split (each chunk's samples shuffled) and keeps what it
    featurized while it fits in ``cfg.keep_mb``; later epochs replay the kept chunks in a
    shuffled order, or stream again when the split did not fit."""

    def __init__(self, path: str, meta: DatasetMeta, layout: FeatureLayout, scale: DenseScale,
                 cfg: LinearReferenceConfig, rng: np.random.Generator) -> None:
        self.path, self.meta, self.layout, self.scale, self.cfg = path, meta, layout, scale, cfg
        self.rng = rng
        self.kept: list[_Encoded] | None = None

    def epoch(self) -> Iterator[_Encoded]:
        if self.kept is not None:
            for i in self.rng.permutation(len(self.kept)):
                yield self.kept[i]
            return
        kept: list[_Encoded] | None = []
        held = 0
        for arrays in iter_chunks(self.path, self.meta, "train", self.cfg.chunk_rows,
                                  truncate=True):
            arrays = arrays.take(self.rng.permutation(len(arrays)))
            chunk = _Encoded(encode(arrays, self.layout, self.scale), _labels(arrays))
            held += chunk.nbytes
            if kept is not None and held > self.cfg.keep_mb * 2**20:
                kept = None  # does not fit: the later epochs stream the split again
            if kept is not None:
                kept.append(chunk)
            yield chunk
        self.kept = kept


def _train_epoch(model: LinearModel, opt: torch.optim.Optimizer, chunks: Iterator[_Encoded],
                 batch_size: int, rng: np.random.Generator) -> int:
    """One pass: every chunk's minibatches in a shuffled order; returns the samples seen."""
    seen = 0
    for chunk in chunks:
        n = len(chunk.bags)
        for start in rng.permutation(np.arange(0, n, batch_size)).tolist():
            stop = min(start + batch_size, n)
            opt.zero_grad(set_to_none=True)
            _loss(model(TorchBags.of(chunk.bags, start, stop)),
                  chunk.labels[start:stop]).backward()
            opt.step()
        seen += n
    return seen


def _first_dense(path: str, meta: DatasetMeta, cfg: LinearReferenceConfig) -> DenseScale:
    """The dense scale from the first chunk of the train split."""
    first = next(iter_chunks(path, meta, "train", cfg.chunk_rows, truncate=True))
    return DenseScale.fit(first.dense)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Torch on one thread for the block: the steps are small, and extra threads on a busy
    CPU cost more than they bring (and one thread keeps the sums in one order)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class FittedReference:
    """The trained reference with what scoring it needs: its features' layout and the dense
    scale of its training split."""

    model: LinearModel
    layout: FeatureLayout
    scale: DenseScale
    train_samples: int

    @torch.no_grad()
    def eval_chunks(self, path: str, meta: DatasetMeta, cfg: LinearReferenceConfig
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(logits, labels) of each chunk of the eval split, each (rows, tasks), in its
        stored order."""
        for arrays in iter_chunks(path, meta, "eval", cfg.chunk_rows, truncate=True):
            bags = encode(arrays, self.layout, self.scale)
            yield self.model(TorchBags.of(bags, 0, len(arrays))), _labels(arrays)

    def eval_logits(self, path: str, meta: DatasetMeta, cfg: LinearReferenceConfig
                    ) -> tuple[np.ndarray, np.ndarray]:
        """(logits, labels) of the whole eval split, each (n, tasks), in its stored order."""
        with _one_thread():
            chunks = list(self.eval_chunks(path, meta, cfg))
        return (np.concatenate([c[0].numpy() for c in chunks]),
                np.concatenate([c[1].numpy() for c in chunks]))

    def evaluate(self, path: str, meta: DatasetMeta, cfg: LinearReferenceConfig
                 ) -> dict[str, TaskScores]:
        """Held-out NE, AUC and calibration per task on the eval split (CVR on clicked
        samples)."""
        evaluators = {task: TaskEvaluator() for task in TASKS}
        with _one_thread():
            for logits, labels in self.eval_chunks(path, meta, cfg):
                clicked = labels[:, 0] > 0.5
                evaluators["ctr"].update(logits[:, 0], labels[:, 0])
                evaluators["cvr"].update(logits[:, 1], labels[:, 1], clicked)
        return {task: ev.compute() for task, ev in evaluators.items()}


def fit(path: str, meta: DatasetMeta, cfg: LinearReferenceConfig) -> FittedReference:
    """Train the reference on ``path``'s train split (deterministic for a given dataset and
    config: seeded shuffles, one thread)."""
    with _one_thread():
        torch.manual_seed(cfg.seed)
        rng = np.random.default_rng(cfg.seed)
        layout = FeatureLayout.for_meta(meta, cfg)
        scale = _first_dense(path, meta, cfg)
        model = LinearModel(layout.size, (meta.ctr_base_rate, meta.cvr_base_rate))
        groups = [{"params": [weight], "weight_decay": l2}
                  for weight, l2 in zip(model.weights, (cfg.l2_ctr, cfg.l2_cvr), strict=True)]
        opt = torch.optim.Adagrad([*groups, {"params": [model.bias], "weight_decay": 0.0}],
                                  lr=cfg.lr)
        chunks = _TrainChunks(path, meta, layout, scale, cfg, rng)
        seen = 0
        for _ in range(cfg.epochs):
            seen += _train_epoch(model, opt, chunks.epoch(), cfg.batch_size, rng)
    return FittedReference(model, layout, scale, seen)


def fit_and_score(path: str, meta: DatasetMeta, cfg: LinearReferenceConfig) -> FitOutcome:
    """Train the reference on ``path``'s train split and score it on its eval split."""
    fitted = fit(path, meta, cfg)
    return FitOutcome(fitted.evaluate(path, meta, cfg), fitted.train_samples, fitted.layout.size)
