"""Whether a failure is an interrupt: Ctrl-C, or SIGTERM/SIGHUP (which gemctl turns into a
KeyboardInterrupt), or a SystemExit, even where code the interrupt ran through replaced it.

An interrupt unwinds through cleanup code (a ``finally``, a context manager's exit, an
``except`` that raises its own error). When that code raises, the interrupt survives only as
the new exception's ``__context__`` (or ``__cause__``), and a check of the exception's type
alone would record a stopped run FAILED instead of KILLED."""

from __future__ import annotations

Interrupt = KeyboardInterrupt | SystemExit


def interrupt_in(err: BaseException) -> KeyboardInterrupt | SystemExit | None:
    """The interrupt ``err`` is, or was raised while handling (its cause/context chain);
    None for a failure no interrupt led to."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        exc = todo.pop()
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, Interrupt):
            return exc
        todo += [e for e in (exc.__context__, exc.__cause__) if e is not None]
    return None
