"""Library output (Ray's driver and worker logs, MLflow's INFO lines, torchmetrics and other
warnings, fbgemm's banners, Tune's tables) routed to a log file while a command runs, so the
terminal shows gemctl's own progress and results only. ``--verbose`` leaves it on the
terminal.

Routing works on the file descriptors (1 and 2), so output from C++ code and from loggers
created before the command started is caught too. gemctl's consoles keep writing to the
terminal. Training progress does not pass through here: it reaches gemctl as typed events
(gem_platform.progress), never as library lines.

Either way (log file or ``--verbose``), credentials in library lines are masked: every log
record and every line written to ``sys.stdout``/``sys.stderr`` (gem_platform.log_mask).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import TextIO

from gem_platform import log_mask
from gemctl import render

LOG_DIR = Path("gem_runs/logs")
# Before Ray, MLflow or torch are imported: no colour codes in forwarded lines, no "repeated
# Nx" folding of the per-step lines a sweep's trials print, no MLflow progress bars.
QUIET_ENV = {"RAY_COLOR_PREFIX": "0", "RAY_DEDUP_LOGS": "0",
             "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "TQDM_DISABLE": "1"}


def log_path(label: str) -> Path:
    """A fresh log file name under gem_runs/logs/ for one command."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)[:80] or "gemctl"
    return LOG_DIR / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def _fd_of(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


class LibraryOutput:
    """Context manager: while active, fds 1 and 2 (and sys.stdout/err) go to ``path``;
    render's consoles and JSON results keep the real terminal. With ``verbose`` nothing is
    redirected. ``path`` is None when verbose."""

    def __init__(self, label: str, verbose: bool = False) -> None:
        self.verbose = verbose
        self.path: Path | None = None if verbose else log_path(label)
        for key, value in QUIET_ENV.items():
            if key != "RAY_DEDUP_LOGS" or not verbose:
                os.environ.setdefault(key, value)

    def __enter__(self) -> LibraryOutput:
        log_mask.install()
        if self.verbose:
            self._show_masked()
            return self
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._log = open(self.path, "a", buffering=1, encoding="utf-8", errors="replace")
        self._sys = (sys.stdout, sys.stderr)
        self._saved_fds: list[tuple[int, int]] = []
        terminals = []
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            if _fd_of(stream) == fd:  # a real process stream: keep a copy for the consoles
                keep = os.dup(fd)
                self._saved_fds.append((fd, keep))
                terminals.append(os.fdopen(os.dup(keep), "w", buffering=1, encoding="utf-8",
                                           errors="replace"))
            else:  # already captured (a test runner): write where it points
                terminals.append(stream)
        self._terminals = terminals
        for fd, _ in self._saved_fds:
            os.dup2(self._log.fileno(), fd)
        self._consoles = [(c, c._file) for c in (render.console, render.err_console)]
        render.console.file, render.err_console.file = terminals[0], terminals[1]
        render.result_stream = terminals[0]
        for name in ("stdout", "stderr"):
            setattr(sys, name, log_mask.MaskedLines(self._log, strip_ansi=True))
        return self

    def _show_masked(self) -> None:
        """--verbose: library lines stay on the terminal, their credentials masked; gemctl's
        consoles and results keep the real streams."""
        self._sys = (sys.stdout, sys.stderr)
        self._consoles = [(c, c._file) for c in (render.console, render.err_console)]
        render.console.file, render.err_console.file = self._sys
        render.result_stream = self._sys[0]
        sys.stdout = log_mask.MaskedLines(self._sys[0])  # type: ignore[assignment]
        sys.stderr = log_mask.MaskedLines(self._sys[1])  # type: ignore[assignment]

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if self.verbose:
            sys.stdout, sys.stderr = self._sys
            for console, file in self._consoles:
                console._file = file
            render.result_stream = None
            return
        sys.stdout, sys.stderr = self._sys
        for fd, keep in self._saved_fds:
            os.dup2(keep, fd)
            os.close(keep)
        for console, file in self._consoles:
            console._file = file
        render.result_stream = None
        for stream in self._terminals:
            if stream not in self._sys:
                stream.flush()
                stream.close()
        self._log.close()
        if self.path is not None and self.path.stat().st_size == 0:
            self.path.unlink()  # nothing was routed: no empty file to point at
            self.path = None
