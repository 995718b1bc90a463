"""Quality metrics per task: NE (normalized entropy), AUC and calibration, exact under data
parallelism.

NE = mean log loss / entropy of the base rate, where the base rate is the mean label of the
same evaluated samples. Calibration = sum of predicted probabilities / sum of labels (1.0: the
model predicts as many positives as there are), from torchrec.metrics' calibration states.
Their sums (loss, positives, count, calibration numerator and denominator) are all-reduced;
AUC uses torchmetrics' exact BinaryAUROC, which gathers predictions across ranks.

Each score comes with its standard error on the samples scored, so a reader can tell a change
between two evaluations from the noise of a small held-out sample: NE's by the delta method
over the per-sample log loss and label, AUC's by Hanley and McNeil (1982), which errs on
the large side (by ~14% in tests/train/test_metrics.py).
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


def auc_standard_error(auc: float, positives: float, negatives: float) -> float:
    """Hanley-McNeil standard error of an AUC measured on this many positives and negatives
    (NaN where either is 0 or the AUC is undefined)."""
    if not (positives > 0 and negatives > 0 and math.isfinite(auc)):
        return float("nan")
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (positives - 1) * (q1 - auc * auc)
           + (negatives - 1) * (q2 - auc * auc)) / (positives * negatives)
    return math.sqrt(max(var, 0.0))


def ne_standard_error(loss_sum: float, loss_sq_sum: float, positive_loss_sum: float,
                      positives: float, count: float) -> float:
    """Standard error of NE = mean log loss / H(base rate) over ``count`` samples, by the delta
    method on both means (the base rate is measured on the same samples, so it moves with
    them): from the sums of the per-sample log loss, of its square, of it over the positives,
    and the positives."""
    if count < 2 or not 0 < positives < count:
        return float("nan")
    p, loss = positives / count, loss_sum / count
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    slope = loss * math.log((1 - p) / p) / entropy  # -H x dNE/dp at a fixed mean loss
    var_loss = loss_sq_sum / count - loss * loss
    cov = positive_loss_sum / count - loss * p
    var = (var_loss + slope * slope * p * (1 - p) - 2 * slope * cov) / (entropy * entropy)
    return math.sqrt(max(var, 0.0) / (count - 1))


@dataclass
class TaskScores:
    ne: float
    auc: float
    log_loss: float
    base_rate: float
    count: int
    calibration: float = float("nan")  # predicted / actual positives; nan without positives
    se_ne: float = float("nan")  # standard errors of NE and AUC on the samples scored
    se_auc: float = float("nan")


class TaskEvaluator:
    """Accumulates logits and labels of one task (optionally masked), then scores them."""

    def __init__(self) -> None:
        self.auroc = BinaryAUROC(thresholds=None)
        # log loss, positives, count, calibration numerator, calibration denominator,
        # squared log loss, log loss of the positives
        self.sums = torch.zeros(7, dtype=torch.float64)

    def update(self, logits: torch.Tensor, labels: torch.Tensor,
               mask: torch.Tensor | None = None) -> None:
        logits, labels = logits.detach().float().cpu(), labels.detach().float().cpu()
        if mask is not None:
            mask = mask.cpu()
            logits, labels = logits[mask], labels[mask]
        if labels.numel():
            loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
            cal = get_calibration_states(labels.double(), torch.sigmoid(logits.double()),
                                         torch.ones_like(labels, dtype=torch.float64))
            self.sums += torch.tensor([loss.sum().item(), labels.sum().item(), labels.numel(),
                                       cal[CALIBRATION_NUM].item(),
                                       cal[CALIBRATION_DENOM].item(),
                                       loss.double().square().sum().item(),
                                       (loss.double() * labels).sum().item()],
                                      dtype=torch.float64)
        # Updated even when empty, so every rank joins the AUROC's collective gather.
        self.auroc.update(torch.sigmoid(logits), labels.long())

    def compute(self) -> TaskScores:
        sums = self.sums.clone()
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.all_reduce(sums)
        (loss_sum, positives, count, cal_num, cal_denom, loss_sq_sum,
         positive_loss_sum) = sums.tolist()
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
                          int(count), calibration,
                          ne_standard_error(loss_sum, loss_sq_sum, positive_loss_sum,
                                            positives, count),
                          auc_standard_error(auc, positives, count - positives))
