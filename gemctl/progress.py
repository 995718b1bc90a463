"""Training progress as a user watches it: step/total, loss, train NE beside the latest
held-out NE, samples/s, elapsed and ETA, per run, per sweep trial and for a sweep overall.

It reads the progress lines the training loop prints on rank 0 (``step N/T loss L ne_ctr E
samples/s S ...``, and at each scheduled evaluation ``eval step N/T held-out ne_ctr H ...``),
whether they arrive through the echo callback (``gemctl submit``, local or on Ray) or through
Ray's log forwarding from sweep trials (``[arm seed S] step ...``). In a terminal it draws rich
progress bars; elsewhere (a log, CI, a pipe) it prints plain lines without ANSI codes, each
with elapsed time and ETA. Evaluation lines and warnings are printed as they come, in both.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from gemctl.render import duration

STEP = re.compile(r"\bstep\s+(?P<step>\d+)/(?P<total>\d+)\s+loss\s+(?P<loss>\S+)"
                  r"(?:\s+ne_ctr\s+(?P<ne>\S+))?(?:\s+samples/s\s+(?P<sps>[\d,.]+))?")
EVAL = re.compile(r"\beval step\s+(?P<step>\d+)/(?P<total>\d+)\s+held-out ne_ctr\s+(?P<ne>\S+)")
# A sweep trial's lines, possibly behind Ray's "(run_trial pid=123)" prefix.
TRIAL = re.compile(r"^(?:\([^)]*\)\s*)?\[(?P<arm>[^\]\s]+) seed (?P<seed>-?\d+)\]\s?(?P<rest>.*)$")
TRIAL_DONE = re.compile(r"\btrial (?P<arm>\S+) seed (?P<seed>-?\d+) "
                        r"(?P<what>finished|already recorded|FAILED)")
INPROCESS_DONE = re.compile(r"^(NE ctr |already in )")


@dataclass(frozen=True)
class StepReport:
    """One progress line of the training loop."""

    step: int
    total: int
    loss: float
    ne: float | None = None
    samples_per_s: float | None = None

    def stats(self, held_out_ne: float | None = None) -> str:
        """Loss, train NE and, once the run has evaluated, the latest held-out NE beside it."""
        parts = [f"loss {self.loss:.4f}"]
        if self.ne is not None:
            parts.append(f"train ne {self.ne:.4f}")
        if held_out_ne is not None:
            parts.append(f"held-out ne {held_out_ne:.4f}")
        if self.samples_per_s is not None:
            parts.append(f"{self.samples_per_s:,.0f} samples/s")
        return "  ".join(parts)


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_step(line: str) -> StepReport | None:
    """The StepReport in a progress line, or None for any other line."""
    m = STEP.search(line)
    if m is None:
        return None
    loss = _number(m["loss"])
    return StepReport(int(m["step"]), int(m["total"]), math.nan if loss is None else loss,
                      _number(m["ne"]), _number(m["sps"]))


def parse_eval(line: str) -> float | None:
    """The held-out CTR NE of an evaluation line, or None for any other line."""
    m = EVAL.search(line)
    return None if m is None else _number(m["ne"])


class _Clock:
    """Elapsed time and an ETA from the steps seen since the first report (so a resumed run's
    replayed steps and start-up time don't skew the rate)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.first: tuple[float, int] | None = None

    def eta(self, step: int, total: int) -> float | None:
        now = time.monotonic()
        if self.first is None:
            self.first = (now, step)
            done, spent = step, now - self.start
        else:
            done, spent = step - self.first[1], now - self.first[0]
        if done <= 0 or spent <= 0:
            return None
        return (total - step) * spent / done

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class TrainingProgress:
    """Progress display for one run (``label``) or a sweep of ``trials`` trials.

    Feed it lines with :meth:`echo` (any line: progress lines update the display, others are
    printed as they are) or :meth:`take` (for routed library output: returns True for the
    sweep lines it shows, False for lines that belong in the log). ``plain`` defaults to
    "stdout is not a terminal".
    """

    def __init__(self, console: Console, label: str, trials: int | None = None,
                 plain: bool | None = None) -> None:
        self.console, self.label, self.trials = console, label, trials
        self.plain = not console.is_terminal if plain is None else plain
        self.clock = _Clock()
        self._clocks: dict[str, _Clock] = {}
        self._held_out: dict[str, float] = {}  # the latest held-out NE ctr per run or trial
        self._tasks: dict[str, TaskID] = {}
        self._done: set[str] = set()
        self._overall: TaskID | None = None
        self._bars: Progress | None = None

    def __enter__(self) -> TrainingProgress:
        if not self.plain:
            self._bars = Progress(
                TextColumn("{task.description}", markup=False), BarColumn(bar_width=24),
                MofNCompleteColumn(), TextColumn("{task.fields[stats]}", markup=False),
                TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("eta"),
                TimeRemainingColumn(), console=self.console, refresh_per_second=4,
                redirect_stdout=False, redirect_stderr=False)
            self._bars.start()
            if self.trials:
                self._overall = self._bars.add_task("trials", total=self.trials, stats="")
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bars is not None:
            self._bars.stop()
            self._bars = None

    @property
    def wall_s(self) -> float:
        return self.clock.elapsed()

    def print(self, text: str) -> None:
        """A message line (printed literally, above the bars in a terminal)."""
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def echo(self, line: str) -> None:
        """Show one line of training output."""
        if not self.take(line):
            self.print(line)

    def take(self, line: str) -> bool:
        """Show ``line`` if it is progress (of the run or of a sweep trial); True if shown."""
        m = TRIAL.match(line)
        if m is not None:
            key = f"{m['arm']} seed {m['seed']}"
            rest = m["rest"]
            if INPROCESS_DONE.match(rest):
                self.print(f"[{key}] {rest}")
                self._trial_done(key)
                return True
            return self._step(key, rest, prefix=f"[{key}] ")
        done = TRIAL_DONE.search(line)
        if done is not None:
            self.print(line[done.start():])
            self._trial_done(f"{done['arm']} seed {done['seed']}")
            return True
        if self.trials is None:
            return self._step(self.label, line, prefix="")
        return False

    def _step(self, key: str, text: str, prefix: str) -> bool:
        held_out = parse_eval(text)
        if held_out is not None:
            self._held_out[key] = held_out
            self.print(prefix + text)
            return True
        report = parse_step(text)
        if report is None:
            if prefix:  # a trial's other lines (resumed from ..., warnings it printed)
                self.print(prefix + text)
                return True
            return False
        # A run's clock starts with the command; a sweep trial's with its first line.
        clock = self.clock if key == self.label else self._clocks.setdefault(key, _Clock())
        eta = clock.eta(report.step, report.total)
        stats = report.stats(self._held_out.get(key))
        if self._bars is None:
            self.print(f"{prefix}step {report.step:>{len(str(report.total))}}/{report.total}  "
                       f"{stats}  elapsed {duration(clock.elapsed())}  eta "
                       f"{'-' if eta is None else duration(eta)}")
            return True
        if key not in self._tasks:
            self._tasks[key] = self._bars.add_task(key, total=report.total, stats="")
        self._bars.update(self._tasks[key], completed=report.step, total=report.total,
                          stats=stats)
        return True

    def _trial_done(self, key: str) -> None:
        if key in self._done:
            return
        self._done.add(key)
        if self._bars is None:
            if self.trials:
                self.print(f"trials {len(self._done)}/{self.trials} done, elapsed "
                           f"{duration(self.clock.elapsed())}")
            return
        if key in self._tasks:
            self._bars.update(self._tasks[key], visible=False)
        if self._overall is not None:
            self._bars.update(self._overall, completed=len(self._done))
