"""How every gemctl command ends: bad input is one paragraph and exit code 2, a run that failed
after it started exits 1, an interrupt (Ctrl-C, SIGTERM or SIGHUP) exits 130. No traceback
reaches the user for any of them."""

from __future__ import annotations

import errno
import functools
import signal
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from gemctl import render

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_CODES = ("Exit codes: 0 success; 1 the run or job failed after it started; 2 bad input "
              "(the message names it and the fix); 130 interrupted (Ctrl-C, SIGTERM, a closed "
              "terminal).")

F = TypeVar("F", bound=Callable[..., Any])


# `kill` and a closed terminal stop a command as Ctrl-C does (its run closed KILLED).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _terminate_as_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def user_errors(fn: F) -> F:
    """Wrap a command: GemError -> its problem and fix on stderr, exit 2; KeyboardInterrupt
    (SIGTERM and SIGHUP are turned into one, so a killed command or a closed terminal still
    closes its MLflow run and stops the servers it started) -> exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from gem_platform import log_mask
        from gem_platform.errors import GemError

        log_mask.install()  # no credential in any log line of this command
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) != signal.SIG_IGN:  # `nohup gemctl ...` keeps running
                signal.signal(sig, _terminate_as_interrupt)
        try:
            return fn(*args, **kwargs)
        except GemError as err:
            render.error(err.problem, err.fix)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except KeyboardInterrupt:
            render.error("Interrupted.")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except OSError as err:
            if err.errno not in PATH_ERRNOS:
                raise
            render.error(*path_problem(err))
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except Exception as err:
            if not _from_the_store(err):
                raise
            first = (str(err).strip().splitlines() or [""])[0][:300]
            render.error(f"MLflow refused the request: {type(err).__name__}: {first}",
                         "Check the ids and names you passed (quotes are not allowed in them) "
                         "and --tracking-uri / MLFLOW_TRACKING_URI (a reachable server, or a "
                         "writable sqlite file made by this MLflow version).")
            raise typer.Exit(EXIT_BAD_INPUT) from None

    return wrapper  # type: ignore[return-value]


# A file or folder the command was given or works in can't be used: the user's environment
# (a read-only working folder, a full disk, a name too long, a missing folder), not a bug.
PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
               errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP}


def path_problem(err: OSError) -> tuple[str, str]:
    """The problem and fix for an OSError on a path (see PATH_ERRNOS)."""
    where = str(err.filename if err.filename is not None else "a file")[:300]
    problem = f"Can't use {where}: {err.strerror or err}."
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return problem, "Free space on that disk, or point the command's output elsewhere."
    if err.errno == errno.ENAMETOOLONG:
        return problem, "Shorten the path: each name in it at most 255 bytes."
    if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP):
        return problem, "Check the path: its folders must exist (and be folders)."
    return problem, ("Run gemctl from a folder you can write (it keeps gem_runs/ and "
                     "mlflow.db there) and pass paths you can read and write.")


def _from_the_store(err: BaseException) -> bool:
    """An exception raised inside MLflow or its database layer (a store problem, not ours)."""
    return type(err).__module__.split(".")[0] in ("mlflow", "sqlalchemy", "alembic")


def run_failed(message: str, fix: str) -> typer.Exit:
    """Report a run that failed after it started; the caller raises the returned Exit(1)."""
    render.error(message, fix)
    return typer.Exit(EXIT_FAILED)
