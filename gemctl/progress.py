"""Training progress as a user watches it: step/total, loss, train NE beside the latest
held-out NE, samples/s, elapsed and ETA, per run, per sweep trial and for a sweep overall.

It renders the typed events of gem_platform.progress that the training loop (rank 0), the
sweep trials and the sweep runner send through the echo callback: StepProgress,
EvalProgress, TrialProgress (a trial's event), TrialDone, and text. In a terminal it draws
rich progress bars; elsewhere (a log, CI, a pipe) it prints plain lines without ANSI codes,
each with elapsed time and ETA. Evaluations, text and warnings are printed as they come, in
both.
"""

from __future__ import annotations

import time
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

from gem_platform.progress import EvalProgress, Event, StepProgress, TrialDone, TrialProgress
from gemctl.render import duration


def step_stats(event: StepProgress, held_out_ne: float | None = None) -> str:
    """Loss, train NE and, once the run has evaluated, the latest held-out NE beside it."""
    parts = [f"loss {event.loss:.4f}", f"train ne {event.train_ne:.4f}"]
    if held_out_ne is not None:
        parts.append(f"held-out ne {held_out_ne:.4f}")
    parts.append(f"{event.samples_per_s:,.0f} samples/s")
    return "  ".join(parts)


class _Clock:
    """Elapsed time and an ETA from the steps seen since the first report (so a resumed run's
    replayed steps and start-up time don't skew the rate)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.first: tuple[float, int] | None = None
        self.last = 0  # the step last reported

    def eta(self, step: int, total: int) -> float | None:
        now = time.monotonic()
        self.last = step
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

    Feed it events with :meth:`echo` (steps update the display, the others are printed as
    they come). ``plain`` defaults to "stdout is not a terminal".
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

    def echo(self, event: Event) -> None:
        """Show one progress event (of the run, of a sweep trial, or a trial's end)."""
        if isinstance(event, TrialProgress):
            self._show(event.trial, event.event, prefix=f"[{event.trial}] ")
        elif isinstance(event, TrialDone):
            self.print(str(event))
            self._trial_done(event.trial)
        else:
            self._show(self.label, event, prefix="")

    def _show(self, key: str, event: StepProgress | EvalProgress | str, prefix: str) -> None:
        if isinstance(event, EvalProgress):
            if event.held_out_ne is not None:
                self._held_out[key] = event.held_out_ne
            self.print(f"{prefix}{event}")
        elif isinstance(event, StepProgress):
            self._step(key, event, prefix)
        else:
            self.print(f"{prefix}{event}")

    def _step(self, key: str, event: StepProgress, prefix: str) -> None:
        # A run's clock starts with the command; a sweep trial's with its first event.
        clock = self.clock if key == self.label else self._trial_clock(key, event.step)
        eta = clock.eta(event.step, event.total)
        stats = step_stats(event, self._held_out.get(key))
        if self._bars is None:
            self.print(f"{prefix}step {event.step:>{len(str(event.total))}}/{event.total}  "
                       f"{stats}  elapsed {duration(clock.elapsed())}  eta "
                       f"{'-' if eta is None else duration(eta)}")
            return
        if key not in self._tasks:
            self._tasks[key] = self._bars.add_task(key, total=event.total, stats="")
        self._bars.update(self._tasks[key], completed=event.step, total=event.total,
                          stats=stats)

    def _trial_clock(self, key: str, step: int) -> _Clock:
        """A sweep trial's clock, new at its first report and again (its bar reset) when its
        step goes back: the trial trains again after running out of memory beside others."""
        clock = self._clocks.get(key)
        if clock is None or step < clock.last:
            if clock is not None and self._bars is not None and key in self._tasks:
                self._bars.reset(self._tasks[key])
            clock = self._clocks[key] = _Clock()
        return clock

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
