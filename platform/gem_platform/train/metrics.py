"""Quality metrics per task: NE (normalized entropy), AUC and calibration, exact under data
parallelism.

NE = mean log loss / entropy of the base rate, where the base rate is the mean label of the
same evaluated samples. Calibration = sum of predicted probabilities / sum of labels (1.0: the
model predicts as many positives as there are), from torchrec.metrics' calibration states.
Their sums (loss, positives, count, calibration numerator and denominator) are all-reduced;
AUC uses torchmetrics' exact BinaryAUROC, which gathers predictions across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchmetrics.classification import BinaryAUROC
from torchrec.metrics.calibration import (
    CALIBRATION_DENOM,
    CALIBRATION_NUM,
    compute_calibration,
    get_calibration_states,
)


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
    calibration: float = float("nan")  # predicted / actual positives; nan without positives


class TaskEvaluator:
    """Accumulates logits and labels of one task (optionally masked), then scores them."""

    def __init__(self) -> None:
        self.auroc = BinaryAUROC(thresholds=None)
        # log loss, positives, count, calibration numerator, calibration denominator
        self.sums = torch.zeros(5, dtype=torch.float64)

    def update(self, logits: torch.Tensor, labels: torch.Tensor,
               mask: torch.Tensor | None = None) -> None:
        logits, labels = logits.detach().float().cpu(), labels.detach().float().cpu()
        if mask is not None:
            mask = mask.cpu()
            logits, labels = logits[mask], labels[mask]
        if labels.numel():
            loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
            cal = get_calibration_states(labels.double(), torch.sigmoid(logits.double()),
                                         torch.ones_like(labels, dtype=torch.float64))
            self.sums += torch.tensor([loss.item(), labels.sum().item(), labels.numel(),
                                       cal[CALIBRATION_NUM].item(),
                                       cal[CALIBRATION_DENOM].item()],
                                      dtype=torch.float64)
        # Updated even when empty, so every rank joins the AUROC's collective gather.
        self.auroc.update(torch.sigmoid(logits), labels.long())

    def compute(self) -> TaskScores:
        sums = self.sums.clone()
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.all_reduce(sums)
        loss_sum, positives, count, cal_num, cal_denom = sums.tolist()
        if count == 0:
            return TaskScores(float("nan"), float("nan"), float("nan"), float("nan"), 0)
        base_rate = positives / count
        log_loss = loss_sum / count
        # The condition is global (after the all-reduce), so all ranks enter compute() together.
        auc = float(self.auroc.compute()) if 0 < positives < count else float("nan")
        as64 = torch.float64
        calibration = (float(compute_calibration(torch.tensor(cal_num, dtype=as64),
                                                 torch.tensor(cal_denom, dtype=as64)))
                       if cal_denom > 0 else float("nan"))
        return TaskScores(normalized_entropy(log_loss, base_rate), auc, log_loss, base_rate,
                          int(count), calibration)
