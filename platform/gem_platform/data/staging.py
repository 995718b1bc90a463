"""Writing a dataset folder whole, and cleaning up after writers that died.

A dataset is written into a hidden staging folder beside its place (``.NAME.tmp-PID-XXXX``),
renamed into place only once complete, so a crash never leaves half a dataset where one was.
Each staging folder records its writer (host, process id, process start time) while it is
being written. Every later generation or conversion into the same parent folder (one that only
reuses a current dataset too) removes the staging folders there, of any dataset, whose writer is
gone (same host, process no longer running); it never touches one whose writer is alive, runs on
another host, or did not record itself (those of the same dataset are named in a warning).

Errors of the operating system while writing (a read-only folder, a name too long for the
filesystem, a full disk) become one DataError naming the setting and the fix.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from gem_platform.data.ownership import Writer, check_replaceable
from gem_platform.errors import DataError

log = logging.getLogger(__name__)
WRITER_FILE = ".gem-writer.json"
STAGING_NAME = re.compile(r"\..+\.tmp-.+")  # .NAME.tmp-PID-XXXX, see staged_dataset


@dataclass(frozen=True)
class WriterRecord:
    """Who is writing a staging folder."""

    host: str
    pid: int
    started: int | None  # the process's start time (clock ticks since boot), against pid reuse

    @classmethod
    def mine(cls) -> WriterRecord:
        return cls(socket.gethostname(), os.getpid(), _start_ticks(os.getpid()))

    @classmethod
    def read(cls, folder: Path) -> WriterRecord | None:
        """The folder's record, or None when it has none or it can't be read."""
        try:
            raw = json.loads((folder / WRITER_FILE).read_text())
            record = cls(str(raw["host"]), int(raw["pid"]), raw.get("started"))
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return record if isinstance(record.started, int | None) else None

    def gone(self) -> bool:
        """True only when the writer surely no longer runs: same host, and no process with its
        pid (or one that started at another time)."""
        if self.host != socket.gethostname() or self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # EPERM: alive, another user's
            return False
        now = _start_ticks(self.pid)
        return self.started is not None and now is not None and now != self.started


def _start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` from /proc (None where there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _is_staging_of(name: str, out: Path) -> bool:
    return name.startswith(f".{out.name}.tmp-")


def staging_folders(out: Path, *, any_dataset: bool = False) -> list[Path]:
    """The staging folders of ``out`` beside it (any writer's, alive or not); with
    ``any_dataset``, every staging-named folder (``.NAME.tmp-...``) in ``out``'s parent."""
    try:
        names = os.listdir(out.parent)
    except OSError:  # no parent yet, or one this user can't list: nothing to clean
        return []
    found = []
    for name in sorted(names):
        folder = out.parent / name
        named = _is_staging_of(name, out) or (any_dataset and STAGING_NAME.fullmatch(name))
        if named and folder.is_dir() and not folder.is_symlink():
            found.append(folder)
    return found


def remove_stale_staging(out: Path) -> list[Path]:
    """Remove the staging folders beside ``out`` (of any dataset) that record a writer which
    is gone; returns those removed. A folder that records no writer is kept, and named in a
    warning when it is ``out``'s."""
    removed = []
    for folder in staging_folders(out, any_dataset=True):
        record = WriterRecord.read(folder)
        if record is None:
            if _is_staging_of(folder.name, out):
                log.warning("%s: a staging folder that records no writer; remove it yourself if "
                            "no generation of %s is running", folder, out)
        elif record.gone():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
            log.info("removed %s, left by process %d of this host, which is gone", folder,
                     record.pid)
    return removed


def _swap(tmp: Path, out: Path, tag: str) -> None:
    """Put ``tmp`` in the place of ``out``. The dataset it replaces is moved aside under a
    staging name with this writer's record before it is deleted, so if the writer dies while
    deleting it (seconds, for a large one), the next preparation there removes what is left."""
    old = out.parent / f".{out.name}.tmp-{tag}-replaced"
    if out.exists():
        os.rename(out, old)
        (old / WRITER_FILE).write_text(json.dumps(asdict(WriterRecord.mine())))
    try:
        os.rename(tmp, out)
    except OSError:
        if old.exists() and not out.exists():
            (old / WRITER_FILE).unlink(missing_ok=True)
            os.rename(old, out)  # put the previous dataset back
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_dataset(out: str | Path, what: str, writer: Writer) -> Iterator[Path]:
    """A staging folder that replaces ``out`` only once the block succeeds, and only if
    ``out`` holds nothing but ``writer``'s own dataset (checked before and again just before
    the swap). A crash or an exception leaves ``out`` as it was."""
    out = Path(out)
    check_replaceable(out, what, writer)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out.parent / f".{out.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        (tmp / WRITER_FILE).write_text(json.dumps(asdict(WriterRecord.mine())))
        yield tmp
        (tmp / WRITER_FILE).unlink()
        check_replaceable(out, what, writer)  # the folder may have changed meanwhile
        _swap(tmp, out, tag)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_FIXES = {
    errno.ENAMETOOLONG: "Shorten it: this filesystem takes at most {name_max} bytes per "
                        "folder or file name and {path_max} bytes per path.",
    errno.EROFS: "The folder is read-only: run from a writable folder or point {what} at a "
                 "writable location.",
    errno.EACCES: "This user can't write there: run from a writable folder or point {what} "
                  "at a writable location.",
    errno.ENOSPC: "The disk is full: free space or point {what} at a bigger disk.",
}
_FIXES[errno.EPERM] = _FIXES[errno.EACCES]
_FIXES[errno.EDQUOT] = _FIXES[errno.ENOSPC]


@contextmanager
def os_errors(what: str, out: Path) -> Iterator[None]:
    """Turn an OSError raised while preparing or writing ``out`` into a DataError naming
    ``what`` (the setting that chose it), the system's reason, and the fix."""
    try:
        yield
    except OSError as err:
        limits = _limits(existing_ancestor(out))
        fix = _FIXES.get(err.errno or 0, "Point {what} at a folder this user can write.")
        reason = err.strerror or str(err)
        name = str(err.filename or "")
        where = f" ({_shown(name)})" if name and not name.startswith(str(out)) else ""
        raise DataError(f"{what} {_shown(out)!r} can't be written: {reason}{where}.",
                        fix.format(what=what, **limits)) from None


def _shown(path: str | Path, keep: int = 60) -> str:
    """``path`` for a message: its ends, when it is too long to read whole."""
    text = str(path)
    return text if len(text) <= 2 * keep else f"{text[:keep]}...{text[-keep:]}"


def _limits(folder: Path) -> dict[str, int]:
    """The filesystem's longest name and path, in bytes (POSIX defaults where unknown)."""
    limits = {"name_max": 255, "path_max": 4096}
    for key in limits:
        try:
            limits[key] = os.pathconf(folder, f"PC_{key.upper()}")
        except (OSError, ValueError):
            pass
    return limits


def existing_ancestor(path: Path) -> Path:
    """The nearest folder at or above ``path`` that exists (the one a new path would use)."""
    for parent in (path, *path.absolute().parents):
        try:
            if parent.is_dir():
                return parent
        except OSError:
            continue
    return Path("/")


__all__ = ["WRITER_FILE", "WriterRecord", "existing_ancestor", "os_errors", "remove_stale_staging",
           "staged_dataset", "staging_folders"]
