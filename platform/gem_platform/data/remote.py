"""Object-store and HDFS filesystems whose every wait is bounded, and calls to them that answer
Ctrl-C and SIGTERM while they wait.

pyarrow's defaults let one request to a server that accepts the connection but never answers
wait for minutes (S3 retries it many times; GCS retries for up to fifteen minutes), and a
thread blocked inside pyarrow does not run Python's signal handlers. So every remote
filesystem made here gets a connect timeout, a stall timeout per request (no byte for that
long), a bounded number of attempts or retry time, all from one setting,
``GEM_REMOTE_TIMEOUT_S`` (seconds; a gs:// URI's own ``retry_limit_seconds`` and an hdfs://
URI's own Hadoop options win); and the calls the driver makes before a run (meta.json, listing,
Parquet footers) run in a helper thread that the caller waits for with a deadline, so a signal
interrupts the wait at once. GCS takes no stall timeout per request, so the rows a worker reads
from it go through the same deadline read by read (``open_input``).
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs

from gem_platform.errors import DataError

ENV_TIMEOUT = "GEM_REMOTE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0
ATTEMPTS = 2  # tries of one S3 request (the first and one retry)
T = TypeVar("T")
STORAGE_FIX = ("Check that its endpoint (the URI's host, AWS_ENDPOINT_URL) is reachable and "
               f"answering and that the credentials are right; {ENV_TIMEOUT} sets how long one "
               "request may wait.")
# How pyarrow's object-store clients word a network failure (AWS SDK, curl, google-cloud-cpp).
_NETWORK = re.compile(r"AWS Error|curlCode|google::cloud::Status|[Tt]imeout was reached|"
                      r"timed out|[Cc]onnection (refused|reset)")
_abandoned: list[threading.Event] = []  # set once a call given up on (deadline, signal) ends


@dataclass(frozen=True)
class RemoteTimeouts:
    """How long a remote filesystem may wait: to connect, for the next byte of a request, and
    in all for one call before the caller gives up on it (``deadline_s``)."""

    seconds: float = DEFAULT_TIMEOUT_S

    @classmethod
    def from_env(cls) -> RemoteTimeouts:
        text = os.environ.get(ENV_TIMEOUT, "").strip()
        if not text:
            return cls()
        try:
            seconds = float(text)
        except ValueError:
            seconds = float("nan")
        if not 0.1 <= seconds <= 3600:  # also refuses nan
            raise DataError(f"{ENV_TIMEOUT}={text!r} is not a number of seconds in [0.1, 3600].",
                            f"Set {ENV_TIMEOUT} to e.g. 10, or unset it.")
        return cls(seconds)

    @property
    def deadline_s(self) -> float:
        """Every attempt stalling to its timeout, plus backoff and a margin."""
        return (ATTEMPTS + 1) * self.seconds + 5.0


def _with_query(uri: str, options: dict[str, str]) -> str:
    """``uri`` with ``options`` added to its query, where it does not set them itself."""
    parts = urlsplit(uri)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    merged = {**options, **query}
    return urlunsplit(parts._replace(query=urlencode(merged)))


def _hdfs_options(t: RemoteTimeouts) -> dict[str, str]:
    """Hadoop client settings (HDFS reads query options it does not know as extra_conf)."""
    ms = str(int(t.seconds * 1000))
    return {"ipc.client.connect.timeout": ms, "ipc.client.connect.max.retries": "1",
            "ipc.client.connect.max.retries.on.timeouts": "1", "dfs.client.socket-timeout": ms}


def _bounded_s3(fs: pafs.S3FileSystem, t: RemoteTimeouts) -> pafs.S3FileSystem:
    options = fs.__reduce__()[1][0]  # every option from_uri resolved (endpoint, region, ...)
    options.update(connect_timeout=t.seconds, request_timeout=t.seconds)
    return pafs.S3FileSystem(**options, retry_strategy=pafs.AwsStandardS3RetryStrategy(
        max_attempts=ATTEMPTS))


def _bounded_gcs(fs: pafs.GcsFileSystem, t: RemoteTimeouts) -> pafs.GcsFileSystem:
    options = fs.__reduce__()[1][0]
    if options.get("retry_time_limit") is None:
        options["retry_time_limit"] = timedelta(seconds=t.seconds)
    return pafs.GcsFileSystem(**options)


def open_remote(uri: str, timeouts: RemoteTimeouts | None = None
                ) -> tuple[pafs.FileSystem, str]:
    """The filesystem of an object-store or HDFS ``uri`` with bounded waits, and the path
    inside it (pyarrow errors propagate)."""
    t = timeouts or RemoteTimeouts.from_env()
    if uri.split("://", 1)[0].lower() in ("hdfs", "viewfs"):
        uri = _with_query(uri, _hdfs_options(t))
    fs, inner = bounded(lambda: pafs.FileSystem.from_uri(uri), f"opening {uri}", t)
    if isinstance(fs, pafs.S3FileSystem):
        fs = _bounded_s3(fs, t)
    elif type(fs).__name__ == "GcsFileSystem":  # pyarrow built without GCS lacks the class
        fs = _bounded_gcs(fs, t)  # type: ignore[arg-type]
    return fs, inner


def bounded(fn: Callable[[], T], what: str, timeouts: RemoteTimeouts | None = None) -> T:
    """``fn()`` run in a helper thread; the caller waits at most ``deadline_s`` and answers a
    signal (Ctrl-C, SIGTERM) while it waits. ``what`` names the call in the error."""
    t = timeouts or RemoteTimeouts.from_env()
    box: dict[str, object] = {}
    done = threading.Event()  # waited on, not the thread: an interrupted join() corrupts it

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # raised again in the caller's thread
            box["error"] = err
        finally:
            done.set()

    threading.Thread(target=run, name="gem-remote-call", daemon=True).start()
    try:
        finished = done.wait(t.deadline_s)  # a signal handler runs (and may raise) meanwhile
    except BaseException:
        _abandoned.append(done)
        raise
    if not finished:
        _abandoned.append(done)
        raise DataError(f"{what}: the storage did not answer within {t.deadline_s:.0f} s.",
                        STORAGE_FIX)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def is_network_error(err: BaseException) -> bool:
    """True when pyarrow's client says the network failed (not the bytes it read)."""
    return bool(_NETWORK.search(str(err)))


def read_failed(where: str, err: BaseException) -> DataError:
    """The DataError for a failed read of ``where``: the storage's fault when the network
    failed, else a corrupt or truncated shard."""
    if is_network_error(err):
        return DataError(f"{where} failed: the storage did not answer ({err}).", STORAGE_FIX)
    return DataError(f"{where} failed ({err}).",
                     "The shard is corrupt or truncated; regenerate the dataset.")


class BoundedReads:
    """A remote file (pyarrow NativeFile) whose every read runs through ``bounded``, for
    clients that have no stall timeout of their own to set (GCS): a read that never completes
    ends at the deadline, and a signal interrupts it. Wrap it in ``pyarrow.PythonFile``."""

    def __init__(self, raw: pa.NativeFile, what: str) -> None:
        self._raw, self._what = raw, what

    def read(self, nbytes: int = -1) -> bytes:
        raw = self._raw
        return bounded(lambda: raw.read() if nbytes < 0 else raw.read(nbytes), self._what)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False


def open_input(fs: pafs.FileSystem, path: str) -> pa.NativeFile:
    """``path`` opened for random reads; on a remote filesystem whose client can't be given a
    stall timeout (anything but S3, whose requests carry one), every read is bounded."""
    raw = fs.open_input_file(path)
    if isinstance(fs, pafs.LocalFileSystem | pafs.S3FileSystem):
        return raw
    return pa.PythonFile(BoundedReads(raw, f"reading {path}"), mode="r")


def bounded_on(fs: pafs.FileSystem, fn: Callable[[], T], what: str) -> T:
    """``fn()`` through ``bounded`` when ``fs`` is remote; directly on the local filesystem."""
    if isinstance(fs, pafs.LocalFileSystem):
        return fn()
    return bounded(fn, what)


def exit_now_if_calls_hang(code: object) -> None:
    """End the process now with ``code`` when a remote call that was given up on still runs.

    pyarrow's exit hook waits for every S3 request in flight (up to its timeouts), and skipping
    that hook makes the AWS SDK crash at exit; so the other exit hooks run, then the process
    ends without the interpreter's shutdown. The CLI calls this as it exits."""
    if all(done.is_set() for done in _abandoned):
        return
    finalizer = getattr(pafs, "ensure_s3_finalized", None)
    if finalizer is not None:
        atexit.unregister(finalizer)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


__all__ = ["DEFAULT_TIMEOUT_S", "ENV_TIMEOUT", "STORAGE_FIX", "BoundedReads", "RemoteTimeouts",
           "bounded", "bounded_on", "exit_now_if_calls_hang", "is_network_error", "open_input",
           "open_remote", "read_failed"]
