"""Quality metrics per task: NE (normalized entropy) and AUC, exact under data parallelism.

NE = mean log loss / entropy of the base rate, where the base rate is the mean label of the
same evaluated samples. Its sums (loss, positives, count) are all-reduced; AUC uses
torchmetrics' exact BinaryAUROC, which gathers predictions across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchmetrics.classification import BinaryAUROC


def normalized_entropy(log_loss_mean: float, base_rate: float) -> float:
    """NE of a predictor with this mean log loss on labels with this positive rate.

    Returns NaN when the base rate is 0 or 1 (entropy 0: NE undefined).
    """
    p = base_rate
    if p <= 0.0 or p >= 1.0:
        return float("nan")
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    return log_loss_mean / entropy


@dataclass
class TaskScores:
    ne: float
    auc: float
    log_loss: float
    base_rate: float
    count: int


class TaskEvaluator:
    """Accumulates logits and labels of one task (optionally masked), then scores them."""

    def __init__(self) -> None:
        self.auroc = BinaryAUROC(thresholds=None)
        self.sums = torch.zeros(3, dtype=torch.float64)  # log loss, positives, count

    def update(self, logits: torch.Tensor, labels: torch.Tensor,
               mask: torch.Tensor | None = None) -> None:
        logits, labels = logits.detach().float().cpu(), labels.detach().float().cpu()
        if mask is not None:
            mask = mask.cpu()
            logits, labels = logits[mask], labels[mask]
        if labels.numel():
            loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
            self.sums += torch.tensor([loss.item(), labels.sum().item(), labels.numel()],
                                      dtype=torch.float64)
        # Updated even when empty, so every rank joins the AUROC's collective gather.
        self.auroc.update(torch.sigmoid(logits), labels.long())

    def compute(self) -> TaskScores:
        sums = self.sums.clone()
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.all_reduce(sums)
        loss_sum, positives, count = sums.tolist()
        if count == 0:
            return TaskScores(float("nan"), float("nan"), float("nan"), float("nan"), 0)
        base_rate = positives / count
        log_loss = loss_sum / count
        # The condition is global (after the all-reduce), so all ranks enter compute() together.
        auc = float(self.auroc.compute()) if 0 < positives < count else float("nan")
        return TaskScores(normalized_entropy(log_loss, base_rate), auc, log_loss, base_rate,
                          int(count))
