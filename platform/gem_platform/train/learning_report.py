"""How a held-out evaluation is reported: the curve point it makes, the metrics it publishes
(MLflow), its progress event and warning lines, and the run summary's learning entries.

Names it writes (every evaluation, at its step):
- ``eval/{ne,auc,logloss,base_rate,count,calibration}_{task}``: held-out scores, and
  ``eval_se/{ne,auc}_{task}`` their standard errors on the samples scored (the progress line
  shows each as a 95% interval; after the first scheduled evaluation a note says how wide
  they are when its sample is too small to tell AUC changes of 0.01);
- ``eval/auc_lift_share_{task}``: (AUC - 0.5) / (planted ceiling - 0.5), synthetic data only;
- ``perf/train_s``, ``eval/samples_seen``: training seconds (evaluation excluded) and samples
  trained on (all workers) when the evaluation ran;
- ``train/ne_ctr_since_eval``: train CTR NE over the steps since the previous evaluation;
- ``warn/{ne_above_one,miscalibrated}_{task}``, ``warn/memorization_ctr``: 1 while a check
  fires, else 0 (gem_platform.train.learning).
The summary adds ``quality/eval_curve`` (every evaluation, EvalPoint.to_json),
``quality/warnings`` (messages), ``perf/train_s`` (the run's) and, with train.target_ne,
``quality/target_ne``, ``quality/reached_target`` and ``quality/{step,samples,train_s}_to_target``.

Pure Python: the loop passes in the scores ``evaluate`` returned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gem_platform.progress import EvalProgress, TaskScores
from gem_platform.train.learning import (
    EvalPoint,
    LearningCurve,
    LearningWarning,
    TaskQuality,
    curve_for,
    lift_share,
    time_to_target,
    warning_keys,
)

WARNING_PREFIX = "warning: "
NOTE_PREFIX = "note: "
Z95 = 1.96  # a standard error times this: the half-width of a 95% normal interval
# AUC half-width above which the first scheduled evaluation notes its sample's precision
COARSE_AUC = 0.01


def eval_point(scores: dict[str, float], tasks: Sequence[str], step: int, samples: float,
               train_s: float, train_ne: float) -> EvalPoint:
    """The curve point of the scores ``evaluate`` returned at ``step``."""
    quality = {task: TaskQuality(scores[f"eval/ne_{task}"], scores[f"eval/auc_{task}"],
                                 scores[f"eval/calibration_{task}"],
                                 scores.get(f"eval_se/ne_{task}", math.nan),
                                 scores.get(f"eval_se/auc_{task}", math.nan))
               for task in tasks}
    count = int(scores.get(f"eval/count_{tasks[0]}", 0)) if tasks else 0
    return EvalPoint(step, samples, train_s, train_ne, quality, count)


def eval_metrics(point: EvalPoint, firing: Sequence[LearningWarning],
                 ceilings: dict[str, float] | None) -> dict[str, float]:
    """What an evaluation publishes beside its scores: lift shares, when it ran, the train NE
    beside it, and every warning's state."""
    out = {"perf/train_s": point.train_s, "eval/samples_seen": point.samples,
           "train/ne_ctr_since_eval": point.train_ne}
    for task, q in point.tasks.items():
        if ceilings and task in ceilings:
            out[f"eval/auc_lift_share_{task}"] = lift_share(q.auc, ceilings[task])
    on = {w.key for w in firing}
    out.update({key: float(key in on) for key in warning_keys(point.tasks)})
    return out


def eval_progress(point: EvalPoint, total: int, ceilings: dict[str, float] | None
                  ) -> EvalProgress:
    """The progress event of an evaluation: held-out scores per task (with the share of the
    planted lift where the data has a ceiling) beside the train NE."""
    tasks = {task: TaskScores(q.ne, q.auc, q.calibration,
                              lift_share(q.auc, ceilings[task])
                              if ceilings and task in ceilings else None,
                              Z95 * q.se_ne, Z95 * q.se_auc)
             for task, q in point.tasks.items()}
    return EvalProgress(point.step, total, point.train_ne, tasks)


def precision_line(point: EvalPoint, coarse: float = COARSE_AUC) -> str | None:
    """A note after a run's first scheduled evaluation when its sample is too small to tell
    AUC changes of ``coarse`` between evaluations: how far each task's scores may move by
    chance, and how to narrow it. None when every task's interval is narrower."""
    wide = {task: q for task, q in point.tasks.items() if Z95 * q.se_auc > coarse}
    if not wide:
        return None
    spans = ", ".join(f"{task} AUC ±{Z95 * q.se_auc:.3f} NE ±{Z95 * q.se_ne:.4f}"
                      for task, q in wide.items())
    return NOTE_PREFIX + (
        f"scheduled evaluations score the same {point.eval_samples:,} held-out samples "
        f"(train.eval_sample): 95% intervals {spans}. Against the final evaluation (the "
        "whole eval split, train.eval_max_samples) or another run's curve, smaller "
        "differences can be this sample's noise (between two evaluations of one run less, as "
        "they share it); raise train.eval_sample for a finer curve.")


def warning_line(warning: LearningWarning) -> str:
    """A warning as a progress line."""
    return WARNING_PREFIX + warning.message


def epochs_line(steps: int, steps_per_epoch: int) -> str | None:
    """A warning before a run whose steps go past one epoch of its training split: deep CTR
    models commonly overfit from the first step of their second epoch (embedding rows recall
    the labels they were trained on), which the held-out curve shows only afterwards."""
    if steps <= steps_per_epoch:
        return None
    return WARNING_PREFIX + (
        f"train.steps={steps} covers {steps / steps_per_epoch:.1f} epochs of the training "
        f"split ({steps_per_epoch} steps each). Recommendation models often overfit from the "
        "start of their second epoch, as embedding rows recall the labels they were trained "
        "on, and held-out NE can pass 1 within a few dozen steps (docs/quality). Train within "
        "one epoch on more samples (data.synthetic.num_samples), or watch the held-out "
        "curve (train.eval_every).")


def held_out_scores(summary: dict[str, Any]) -> dict[str, float]:
    """A run summary's final held-out scores: every numeric ``eval/*`` entry (NE, AUC,
    calibration, lift share per task), as measuring tools keep them beside their own figures."""
    return {k: float(v) for k, v in summary.items()
            if k.startswith("eval/") and isinstance(v, int | float)}


def summary_entries(curve: LearningCurve, train_s: float, target_ne: float | None,
                    ceilings: dict[str, float] | None) -> dict[str, Any]:
    """The run summary's learning entries (the last curve point is the final evaluation)."""
    final = curve.final_warnings()
    out: dict[str, Any] = {
        "quality/eval_curve": [p.to_json() for p in curve.points],
        "quality/warnings": [w.message for w in final],
        "quality/evals": float(len(curve.points)),
        "perf/train_s": train_s,
    }
    if curve.points:
        out.update(eval_metrics(curve.points[-1], final, ceilings))
    if target_ne is not None:
        reached = time_to_target(curve_for(curve.points), target_ne)
        out.update({"quality/target_ne": target_ne,
                    "quality/reached_target": float(reached is not None),
                    "quality/step_to_target": reached.step if reached else math.nan,
                    "quality/samples_to_target": reached.samples if reached else math.nan,
                    "quality/train_s_to_target": reached.train_s if reached else math.nan})
    return out
