"""One lock file that serializes processes of a host around a shared resource (a dataset
being written, a tracking store's first set-up, a checkpoint's local copy)."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive_lock(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_file`` (created if missing, never truncated) while
    the block runs; other holders on this host wait. Released when the process dies."""
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
