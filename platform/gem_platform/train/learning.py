"""Whether a run learns, from its held-out evaluation curve: the curve itself, the warnings it
calls for, the share of a planted ceiling reached, and the time to a target NE.

Pure Python (no torch): the training loop feeds it evaluation results; a benchmark can read a
finished run's curve back from its summary JSON (``EvalPoint.from_json``) and compute
``time_to_target`` for any target afterwards.

Time on the curve is training time: the sum of the steps' wall times (each from one step's
read-back to the next), so set-up, evaluation and checkpoint saving are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, NamedTuple

# Passes over its training split a run took (its steps over the steps of one epoch): past 1,
# its held-out scores can measure memorized per-id rows as much as the model, and a comparison
# of such runs says so.
TRAINED_EPOCHS = "train/epochs"

WarningCode = Literal["ne_above_one", "memorization", "miscalibrated"]
# The task whose train NE the loop tracks (the memorization check compares the two curves).
TRAIN_NE_TASK = "ctr"


@dataclass(frozen=True)
class TaskQuality:
    """Held-out quality of one task at one evaluation, with the standard errors of NE and
    AUC on the samples it scored (NaN where not recorded; named se_* so that no reader of
    ``ne_{task}`` keys takes them for a task)."""

    ne: float
    auc: float
    calibration: float  # predicted / observed positives
    se_ne: float = math.nan
    se_auc: float = math.nan


TASK_QUALITY_KEYS = tuple(f.name for f in fields(TaskQuality))  # as a curve point's JSON names


@dataclass(frozen=True)
class EvalPoint:
    """One held-out evaluation: when it ran (step, samples trained on across workers, training
    seconds), the train CTR NE over the steps since the previous evaluation, and each task's
    held-out quality on ``eval_samples`` samples."""

    step: int
    samples: float
    train_s: float
    train_ne: float
    tasks: dict[str, TaskQuality]
    eval_samples: int

    def to_json(self) -> dict[str, Any]:
        """Flat keys, as the run summary's ``quality/eval_curve`` holds them."""
        out: dict[str, Any] = {"step": self.step, "samples": self.samples,
                               "train_s": self.train_s, "train_ne_ctr": self.train_ne,
                               "eval_samples": self.eval_samples}
        for task, q in self.tasks.items():
            out.update({f"{k}_{task}": v for k, v in asdict(q).items()})
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> EvalPoint:
        """The point ``to_json`` wrote."""
        names = [key.removeprefix("ne_") for key in obj if key.startswith("ne_")]
        tasks = {task: TaskQuality(*(float(obj.get(f"{key}_{task}", math.nan))
                                     for key in TASK_QUALITY_KEYS))
                 for task in names}
        return cls(int(obj["step"]), float(obj["samples"]), float(obj["train_s"]),
                   float(obj.get("train_ne_ctr", math.nan)), tasks,
                   int(obj.get("eval_samples", 0)))


class CurvePoint(NamedTuple):
    """(step, samples seen, training seconds, held-out NE): what time to quality reads."""

    step: float
    samples: float
    train_s: float
    ne: float


@dataclass(frozen=True)
class TimeToTarget:
    """Where a held-out NE curve first reaches a target, interpolated between evaluations."""

    step: float
    samples: float
    train_s: float


def time_to_target(curve: Iterable[tuple[float, float, float, float]], target: float
                   ) -> TimeToTarget | None:
    """The first (step, samples, training seconds) at which held-out NE <= ``target``, or None
    if the curve never gets there.

    ``curve`` holds (step, samples seen, training seconds, held-out NE) per evaluation; it is
    read in step order and points with a NaN NE are skipped. Between the last evaluation above
    the target and the first at or below it, the crossing is interpolated linearly; when the
    first evaluation already meets the target, that evaluation is the answer (nothing earlier
    was measured)."""
    points = sorted((CurvePoint(*p) for p in curve if not math.isnan(p[3])),
                    key=lambda p: p.step)
    previous: CurvePoint | None = None
    for point in points:
        if point.ne <= target:
            if previous is None:
                return TimeToTarget(point.step, point.samples, point.train_s)
            frac = (previous.ne - target) / (previous.ne - point.ne)
            return TimeToTarget(*(a + frac * (b - a) for a, b in
                                  zip(previous[:3], point[:3], strict=True)))
        previous = point
    return None


def curve_for(points: Sequence[EvalPoint], task: str = "ctr") -> list[CurvePoint]:
    """The (step, samples, training seconds, held-out NE) curve of one task."""
    return [CurvePoint(p.step, p.samples, p.train_s, p.tasks[task].ne)
            for p in points if task in p.tasks]


def lift_share(auc: float, ceiling: float) -> float:
    """(AUC - 0.5) / (ceiling - 0.5): the share of the planted ceiling's AUC lift over a
    random ranking that the model reaches (1.0 = the ceiling; NaN without a usable ceiling)."""
    if not (math.isfinite(auc) and math.isfinite(ceiling)) or ceiling <= 0.5:
        return math.nan
    return (auc - 0.5) / (ceiling - 0.5)


@dataclass(frozen=True)
class Thresholds:
    """When the checks fire. Memorization: held-out NE rose at each of the last ``rises``
    evaluations, by at least ``min_rise`` in all, while train NE fell by at least
    ``min_train_fall`` over the same evaluations. Calibration: outside [low, high]."""

    rises: int = 2
    min_rise: float = 0.01
    min_train_fall: float = 0.01
    calibration_low: float = 0.8
    calibration_high: float = 1.25


@dataclass(frozen=True)
class LearningWarning:
    """A check that fired at an evaluation: what was seen, what it means, what to try."""

    code: WarningCode
    task: str
    step: int
    message: str

    @property
    def key(self) -> str:
        """Its metric name, e.g. ``warn/memorization_ctr``."""
        return f"warn/{self.code}_{self.task}"


def _ne_above_one(point: EvalPoint, task: str) -> LearningWarning | None:
    ne = point.tasks[task].ne
    if not (math.isfinite(ne) and ne >= 1.0):
        return None
    return LearningWarning("ne_above_one", task, point.step, (
        f"held-out NE {task} {ne:.3f} >= 1 at step {point.step}: the model predicts {task} "
        "worse than the base rate alone would. Early in a run it may not have started "
        "learning yet; if it stays, try a lower train.lr or a longer train.warmup_steps, and "
        "more training samples per id (data.synthetic.num_samples)."))


def _miscalibrated(point: EvalPoint, task: str, t: Thresholds) -> LearningWarning | None:
    cal = point.tasks[task].calibration
    if not math.isfinite(cal) or t.calibration_low <= cal <= t.calibration_high:
        return None
    many = "too many" if cal > 1 else "too few"
    return LearningWarning("miscalibrated", task, point.step, (
        f"held-out calibration {task} {cal:.2f} (predicted / observed positives) is outside "
        f"[{t.calibration_low:g}, {t.calibration_high:g}] at step {point.step}: the model "
        f"predicts {many} positives, which costs NE beyond what its ranking (AUC) loses. "
        "Early it is still finding the base rate; late it usually comes with memorization: "
        "try more training data or fewer steps, or a lower train.lr."))


def _memorization(points: Sequence[EvalPoint], t: Thresholds) -> LearningWarning | None:
    task = TRAIN_NE_TASK
    window = [p for p in points if task in p.tasks][-(t.rises + 1):]
    if len(window) < t.rises + 1:
        return None
    held = [p.tasks[task].ne for p in window]
    train = [window[0].train_ne, window[-1].train_ne]
    if not all(math.isfinite(v) for v in held + train):
        return None
    rising = all(b > a for a, b in zip(held, held[1:], strict=False))
    if not (rising and held[-1] - held[0] >= t.min_rise
            and train[0] - train[1] >= t.min_train_fall):
        return None
    return LearningWarning("memorization", task, window[-1].step, (
        f"held-out NE {task} rose over the last {t.rises} evaluations ({held[0]:.3f} -> "
        f"{held[-1]:.3f}, steps {window[0].step}-{window[-1].step}) while train NE fell "
        f"({train[0]:.3f} -> {train[1]:.3f}): the model memorizes its training samples "
        "(typically from their second epoch) instead of learning what carries over. Try "
        "more training samples (data.synthetic.num_samples), fewer train.steps, a lower "
        "train.sparse_lr, or more train.weight_decay."))


def check(points: Sequence[EvalPoint], thresholds: Thresholds = Thresholds()
          ) -> list[LearningWarning]:
    """The warnings the curve calls for at its last evaluation."""
    if not points:
        return []
    last = points[-1]
    found = [w for task in last.tasks for w in (_ne_above_one(last, task),
                                                _miscalibrated(last, task, thresholds)) if w]
    memorized = _memorization(points, thresholds)
    return found + ([memorized] if memorized else [])


def warning_keys(tasks: Iterable[str]) -> list[str]:
    """Every warning metric a run with these tasks records (0 or 1 at each evaluation)."""
    tasks = list(tasks)
    keys = [f"warn/{code}_{task}" for code in ("ne_above_one", "miscalibrated")
            for task in tasks]
    if TRAIN_NE_TASK in tasks:
        keys.append(f"warn/memorization_{TRAIN_NE_TASK}")
    return keys


@dataclass
class LearningCurve:
    """The run's evaluations so far and the warnings seen: what the loop keeps (and a
    checkpoint saves) so a resumed run continues the same curve."""

    points: list[EvalPoint] = field(default_factory=list)
    memorized: list[LearningWarning] = field(default_factory=list)  # every time it fired
    announced: set[str] = field(default_factory=set)  # warning keys fired so far

    def add(self, point: EvalPoint, thresholds: Thresholds = Thresholds()
            ) -> tuple[list[LearningWarning], list[LearningWarning]]:
        """Append ``point``; return the warnings firing at it, and those of them firing for
        the first time in the run (what a progress line announces: once each, so a check
        that flickers on a noisy sample does not flood the output)."""
        self.points = [p for p in self.points if p.step < point.step] + [point]
        firing = check(self.points, thresholds)
        new = [w for w in firing if w.key not in self.announced]
        self.announced |= {w.key for w in firing}
        self.memorized += [w for w in firing if w.code == "memorization"]
        return firing, new

    def final_warnings(self, thresholds: Thresholds = Thresholds()) -> list[LearningWarning]:
        """What the run summary reports: the warnings firing at the last evaluation, and the
        first memorization seen at any evaluation (once held-out NE has risen it may level
        off, and the harm stays)."""
        firing = check(self.points, thresholds)
        if self.memorized and not any(w.code == "memorization" for w in firing):
            firing.append(self.memorized[0])
        return firing
