"""Training progress as typed events, from the rank that trains to whoever shows it.

The loop sends one :class:`StepProgress` per logged step and one :class:`EvalProgress` per
held-out evaluation; other news (a resume, a warning, a compile after the warm-up) is plain
text. A sweep wraps a trial's events in :class:`TrialProgress` and ends each trial with a
:class:`TrialDone`. Events travel as they are, never as text to be parsed back: through the
``echo`` callback in-process, a Ray queue from Ray Train workers and Ray Tune trials to the
driver (:func:`drain_while`), a multiprocessing queue from a fresh process. gemctl renders
them (progress bars, or plain lines with elapsed time and ETA). ``str(event)`` is the plain
line a log shows where nothing renders them (``print`` as the callback).

Importing this module loads nothing heavy: the CLI reads these types.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class StepProgress:
    """A logged training step: the mean loss and train CTR NE over the steps since the last
    one, the throughput of that window and its straggler overhead (share of step time the
    slowest rank adds)."""

    step: int
    total: int
    loss: float
    train_ne: float
    samples_per_s: float
    straggler: float = math.nan

    def __str__(self) -> str:
        return (f"step {self.step:>5}/{self.total}  loss {self.loss:.4f}  "
                f"ne_ctr {self.train_ne:.4f}  samples/s {self.samples_per_s:.0f}  "
                f"straggler {self.straggler:.1%}")


@dataclass(frozen=True)
class TaskScores:
    """One task's held-out scores; ``lift_share`` is (AUC - 0.5) / (planted ceiling - 0.5)
    where the data has a planted ceiling; ``ne_pm`` and ``auc_pm`` the half-widths of their
    95% intervals on the samples scored (NaN: not known)."""

    ne: float
    auc: float
    calibration: float
    lift_share: float | None = None
    ne_pm: float = math.nan
    auc_pm: float = math.nan


def _pm(half_width: float, digits: int) -> str:
    """"±w" for a known interval half-width, else nothing."""
    return f"±{half_width:.{digits}f}" if math.isfinite(half_width) else ""


@dataclass(frozen=True)
class EvalProgress:
    """A held-out evaluation at ``step``, beside the train CTR NE since the previous one;
    its line gives each NE and AUC with the half-width of its 95% interval where known."""

    step: int
    total: int
    train_ne: float
    tasks: dict[str, TaskScores] = field(default_factory=dict)

    @property
    def held_out_ne(self) -> float | None:
        """Held-out CTR NE (the figure the progress display shows beside train NE)."""
        ctr = self.tasks.get("ctr")
        return None if ctr is None else ctr.ne

    def __str__(self) -> str:
        parts = [f"eval step {self.step:>5}/{self.total}"]
        for task, q in self.tasks.items():
            parts.append(f"held-out ne_{task} {q.ne:.4f}{_pm(q.ne_pm, 4)}")
            if task == "ctr":
                parts.append(f"train ne_ctr {self.train_ne:.4f}")
        for task, q in self.tasks.items():
            auc = f"auc_{task} {q.auc:.4f}{_pm(q.auc_pm, 3)}"
            if q.lift_share is not None and math.isfinite(q.lift_share):
                auc += f" ({q.lift_share:.0%} of planted lift)"
            parts.append(auc)
        parts += [f"calibration_{task} {q.calibration:.2f}" for task, q in self.tasks.items()]
        return "  ".join(parts)


@dataclass(frozen=True)
class TrialProgress:
    """One event of a sweep trial (``trial``: "ARM seed N")."""

    trial: str
    event: StepProgress | EvalProgress | str

    def __str__(self) -> str:
        return f"[{self.trial}] {self.event}"


@dataclass(frozen=True)
class TrialDone:
    """A sweep trial ended: ``finished`` (trained now), ``already recorded`` (an earlier
    attempt's run reused), ``kept`` (already in the results file) or ``FAILED``; ``where``
    names its record (a run id or a results file)."""

    trial: str
    status: Literal["finished", "already recorded", "kept", "FAILED"]
    ne_ctr: float = math.nan
    auc_ctr: float = math.nan
    where: str = ""

    def __str__(self) -> str:
        if self.status == "FAILED":
            return f"trial {self.trial} FAILED"
        if self.status == "kept":
            return f"trial {self.trial} already in {self.where}, kept"
        return (f"trial {self.trial} {self.status}: NE ctr {self.ne_ctr:.4f}, AUC ctr "
                f"{self.auc_ctr:.4f} ({self.where})")


Event = StepProgress | EvalProgress | TrialProgress | TrialDone | str
Echo = Callable[[Event], None]


def in_trial(trial: str, echo: Echo) -> Echo:
    """``echo`` for one sweep trial's events: each wrapped in a TrialProgress."""
    return lambda event: echo(TrialProgress(trial, event))  # type: ignore[arg-type]


def _drain(queue: Any, take: Callable[[Any], None], block: bool) -> None:
    """Hand ``take`` the Ray queue's items until it stays empty (half a second when
    ``block``)."""
    from ray.util.queue import Empty

    while True:
        try:
            take(queue.get(block=block, timeout=0.5))
        except Empty:
            return


def drain_while(work: Callable[[], T], queue: Any, take: Callable[[Any], None]) -> T:
    """Run ``work()`` in a thread while this thread hands every item of the Ray ``queue`` to
    ``take`` (so events show as they come); return what ``work`` returned, or raise what it
    raised, once the queue is drained."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except BaseException as err:  # surfaced in the calling thread below
            outcome["error"] = err

    thread = threading.Thread(target=run, name="gem-work", daemon=True)
    thread.start()
    while thread.is_alive():
        _drain(queue, take, block=True)
    _drain(queue, take, block=False)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@contextlib.contextmanager
def draining(queue: Any, take: Callable[[Any], None]) -> Iterator[None]:
    """While the block runs in this thread (where Ray Tune wants to be, for its signal
    handlers), a background thread hands the Ray ``queue``'s items to ``take``; the rest are
    handed over when the block ends."""
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            _drain(queue, take, block=True)

    thread = threading.Thread(target=run, name="gem-drain", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        _drain(queue, take, block=False)
