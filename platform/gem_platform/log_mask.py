"""Credentials never reach a log line: the password or token of any URI (``user:pass@``, a lone
``token@``, query parameters named like secrets) is masked by :func:`gem_platform.net.redact`
in every logging record this process creates and in every line written to its Python
streams.

Records are masked where they are made (the log record factory), so the mask holds for every
logger and every handler: ours, the libraries' (MLflow, Ray, urllib3), and handlers that are
configured after it is installed; so are the tracebacks of exceptions no handler caught
(``sys.excepthook``, ``threading.excepthook``). Lines a library writes with ``print`` or
``sys.stdout.write`` (MLflow's "View run ... at: URL") are masked by :class:`MaskedLines`, the
stream gemctl puts in place of ``sys.stdout``/``sys.stderr`` while library output is shown or
routed to a log file.

Processes the platform starts (Ray Train workers, sweep trials, spawned children) write to
file descriptors that reach the same log file, the terminal or Ray's worker log files without
passing through gemctl's streams: each masks its own output with :func:`mask_process_output`.
"""

from __future__ import annotations

import io
import logging
import re
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from gem_platform.net import redact

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # terminal colour and cursor codes
_lock = threading.Lock()
_installed: list[Any] = []  # the factory this module wrapped (once installed)


def mask_record(record: logging.LogRecord) -> logging.LogRecord:
    """``record`` with credentials masked in its message and its formatted exception."""
    try:
        message = record.getMessage()
    except Exception:  # a record whose args don't fit its format: logging reports it itself
        return record
    masked = redact(message)
    if masked != message:
        record.msg, record.args = masked, None
    if record.exc_info and not record.exc_text:
        record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    return record


def _through_mask(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` (``sys.excepthook`` or ``threading.excepthook``) printing through a masked
    ``sys.stderr``: a traceback that escaped every handler is the last thing a process
    writes, often after gemctl's own streams are gone."""
    if getattr(hook, "_masks_credentials", False):
        return hook

    def masked(*args: Any) -> Any:
        real = sys.stderr
        if real is None or isinstance(real, MaskedLines):
            return hook(*args)
        sys.stderr = MaskedLines(real)
        try:
            return hook(*args)
        finally:
            sys.stderr.flush()
            sys.stderr = real

    masked._masks_credentials = True  # type: ignore[attr-defined]
    return masked


def install() -> None:
    """Mask credentials in every log record made in this process from now on, and in the
    tracebacks of exceptions no handler caught (idempotent)."""
    with _lock:
        sys.excepthook = _through_mask(sys.excepthook)
        threading.excepthook = _through_mask(threading.excepthook)
        if _installed:
            return
        base = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            return mask_record(base(*args, **kwargs))

        logging.setLogRecordFactory(factory)
        _installed.append(base)


def mask_process_output() -> None:
    """Mask credentials in every log record of this process and in every line it writes to
    ``sys.stdout``/``sys.stderr`` from now on (idempotent). For the entry point of a process
    the platform starts, whose output goes straight to a file descriptor."""
    install()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, MaskedLines):
            setattr(sys, name, MaskedLines(stream))


class MaskedLines(io.TextIOBase):
    """A text stream that writes each complete line to ``sink`` with credentials masked; a
    partial line waits for its end (a URI split over two writes is masked whole) or for
    ``flush``.

    ``strip_ansi`` drops terminal colour codes (for a log file)."""

    def __init__(self, sink: TextIO, *, strip_ansi: bool = False) -> None:
        self.sink, self.strip_ansi, self._partial = sink, strip_ansi, ""

    def writable(self) -> bool:
        return True

    def _clean(self, text: str) -> str:
        plain = ANSI.sub("", text)
        masked = redact(plain)
        if self.strip_ansi:
            return masked
        if masked == plain:
            return text  # no credential: colours kept
        coloured = redact(text)
        shown = ANSI.sub("", coloured)
        # Colour codes inside a URI (rich highlights its parts) hide it from the mask: such a
        # line is written without its colours.
        return coloured if redact(shown) == shown else masked

    def write(self, text: str) -> int:
        if self.sink.closed:
            return len(text)
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            self.sink.write(self._clean(line) + "\n")
        return len(text)

    def flush(self) -> None:
        if self.sink.closed:
            return
        if self._partial:
            self.sink.write(self._clean(self._partial))
            self._partial = ""
        self.sink.flush()

    def isatty(self) -> bool:
        # Libraries ask at exit (colorama's atexit hook, via Ray), after the sink may be closed.
        return not self.sink.closed and self.sink.isatty()

    def fileno(self) -> int:
        return self.sink.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.sink, "encoding", "utf-8")
