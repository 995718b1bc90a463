"""Remote reads never hang: a server that accepts connections but never answers, and a bucket
that can't be reached, end in a clear error within the timeout, and a signal interrupts the
wait at once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from gem_platform.data.parquet import SampleTable, load_meta
from gem_platform.data.remote import ENV_TIMEOUT, RemoteTimeouts, bounded, open_remote
from gem_platform.data.stream import StreamingTable
from gem_platform.errors import DataError
from gem_platform.recipe import recipe_from_dict
from gem_platform.storage import StorageError, check_storage
from tests.data.conftest import refused
from tests.data.stalling_s3 import StallingS3

REPO = Path(__file__).resolve().parents[2]


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.set()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def silent_s3(monkeypatch) -> Iterator[SilentServer]:
    """The environment's S3 endpoint is a server that never answers."""
    server = SilentServer()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield server
    server.close()


def test_s3_filesystems_carry_connect_and_request_timeouts(silent_s3) -> None:
    fs, inner = open_remote("s3://bucket/ds", RemoteTimeouts(7))
    options = fs.__reduce__()[1][0]
    assert (options["connect_timeout"], options["request_timeout"]) == (7, 7)
    assert inner == "bucket/ds"


def test_a_silent_s3_endpoint_fails_within_the_timeout(silent_s3, monkeypatch) -> None:
    monkeypatch.setenv(ENV_TIMEOUT, "1")
    start = time.monotonic()
    with pytest.raises(DataError, match="s3://bucket/ds/meta.json"):
        load_meta("s3://bucket/ds")
    assert silent_s3.accepted.is_set()
    assert time.monotonic() - start < RemoteTimeouts(1).deadline_s


def test_a_silent_endpoint_named_in_the_uri_fails_within_the_timeout(monkeypatch) -> None:
    server = SilentServer()
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                 "AWS_EC2_METADATA_DISABLED": "true", ENV_TIMEOUT: "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    uri = f"s3://bucket/ds?endpoint_override=127.0.0.1:{server.port}&scheme=http&region=x"
    start = time.monotonic()
    try:
        with pytest.raises(DataError, match="meta.json"):
            load_meta(uri)
        assert server.accepted.is_set()
    finally:
        server.close()
    assert time.monotonic() - start < RemoteTimeouts(1).deadline_s


def test_storage_probe_of_a_silent_endpoint_fails_within_the_timeout(silent_s3,
                                                                     monkeypatch) -> None:
    monkeypatch.setenv(ENV_TIMEOUT, "1")
    start = time.monotonic()
    with pytest.raises(StorageError, match="train.storage 's3://bucket/runs'"):
        check_storage(recipe_from_dict({"train": {"storage": "s3://bucket/runs"}}))
    assert time.monotonic() - start < 2 * RemoteTimeouts(1).deadline_s


def test_a_bounded_call_gives_up_at_its_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(DataError, match="reading x: the storage did not answer within 5 s"):
        bounded(lambda: time.sleep(60), "reading x", RemoteTimeouts(0.1))
    assert time.monotonic() - start < 8


# How soon after the signal an interrupted wait must have ended: the interrupt is answered in
# well under a second on a quiet machine, a loaded 2-core CI machine adds seconds of import and
# scheduling; the defect waited out the whole call (60 s here, up to 300 s for Google's client).
ANSWERED_S = 10.0


@contextmanager
def interrupted_after(seconds: float) -> Iterator[None]:
    """A KeyboardInterrupt (what gemctl turns Ctrl-C and SIGTERM into) ``seconds`` in."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_signal_interrupts_a_bounded_call_at_once() -> None:
    start = time.monotonic()
    with interrupted_after(0.3):
        bounded(lambda: time.sleep(60), "reading x", RemoteTimeouts(60))
    assert time.monotonic() - start < 0.3 + ANSWERED_S


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "1e9"])
def test_a_bad_timeout_setting_is_refused(monkeypatch, value) -> None:
    monkeypatch.setenv(ENV_TIMEOUT, value)
    with pytest.raises(DataError, match=ENV_TIMEOUT):
        RemoteTimeouts.from_env()


def test_submit_of_an_unreachable_gcs_bucket_fails_clearly_within_30_s(gemctl, tmp_path,
                                                                    monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV_TIMEOUT, raising=False)  # the default timeouts
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    start = time.monotonic()
    result = gemctl("submit", str(REPO / "recipes/demo.yaml"), "--local", "--set",
                    "data.source=parquet", "--set", "data.path=gs://nobucket/x")
    refused(result, "gs://nobucket/x/meta.json")
    assert time.monotonic() - start < 30


def test_sigterm_stops_a_submit_waiting_on_a_silent_endpoint(silent_s3, tmp_path) -> None:
    env = {**os.environ, ENV_TIMEOUT: "300",
           "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("platform", "kernels", ""))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gemctl.main", "submit", str(REPO / "recipes/demo.yaml"),
         "--local", "--set", "data.source=parquet", "--set", "data.path=s3://bucket/ds"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert silent_s3.accepted.wait(120), "submit never reached the endpoint"
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - sent < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Interrupted" in err and "Traceback" not in err



@pytest.fixture
def stalling_s3(tiny_dataset, monkeypatch) -> Iterator[StallingS3]:
    """The environment's S3 endpoint serves the tiny dataset as s3://bucket/ds but never
    answers a read of a row group."""
    server = StallingS3(tiny_dataset.parent)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", ENV_TIMEOUT: "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield server
    server.close()


@pytest.mark.parametrize("reader", ["table", "stream"])
def test_a_row_group_read_that_stalls_fails_within_the_timeout(stalling_s3, reader) -> None:
    """meta.json, the listing and the footers arrive; the rows never do. Both readers give up
    within the request timeout and say the storage did not answer (not that the shard is
    corrupt)."""
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        if reader == "table":
            SampleTable.load("s3://bucket/ds", "train")
        else:
            StreamingTable("s3://bucket/ds", "train")  # reads every seq_len first
    assert stalling_s3.stalled.is_set()
    assert time.monotonic() - start < 2 * RemoteTimeouts(1).deadline_s
    assert "train-00000.parquet" in err.value.problem
    assert "the storage did not answer" in err.value.problem
    assert ENV_TIMEOUT in err.value.fix and "corrupt" not in err.value.fix


def test_a_signal_stops_a_wait_on_an_unreachable_gcs_bucket(monkeypatch) -> None:
    """`data.path=gs://nobucket/x` with no credentials: Google's client retries for as long as
    it may (here up to 300 s); Ctrl-C or SIGTERM (turned into KeyboardInterrupt by gemctl)
    stops the wait at once."""
    monkeypatch.setenv(ENV_TIMEOUT, "300")
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)

    start = time.monotonic()
    with interrupted_after(1.0):
        load_meta("gs://nobucket/x")
    assert time.monotonic() - start < 1.0 + ANSWERED_S


class _StallingFile:
    """A local file whose reads of anything but its tail (the footer) never return."""

    def __init__(self, path: str, release: threading.Event) -> None:
        self.f = open(path, "rb")  # noqa: SIM115 (closed by close())
        self.size = os.path.getsize(path)
        self.release = release
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        if n < 0 or self.f.tell() + n < self.size:
            self.release.wait()
        return self.f.read(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def close(self) -> None:
        self.closed = True
        self.f.close()


def test_a_row_group_read_from_a_client_without_stall_timeouts_ends_at_the_deadline(
        tiny_dataset, monkeypatch) -> None:
    """A filesystem whose client takes no stall timeout (GCS; here pyarrow's PyFileSystem over
    local files whose row groups never arrive): the footer is read, the rows are given up on at
    the deadline with the storage named, instead of waiting forever inside a worker."""
    import fsspec
    import pyarrow as pa

    from gem_platform.data.source import Piece, RowGroup, open_parquet, read_piece

    release = threading.Event()

    class Stalling(pafs.FSSpecHandler):
        def open_input_file(self, path):
            return pa.PythonFile(_StallingFile(path, release), mode="r")

    monkeypatch.setenv(ENV_TIMEOUT, "0.5")
    fs = pafs.PyFileSystem(Stalling(fsspec.filesystem("file")))
    name = str(tiny_dataset / "train-00000.parquet")
    handle = open_parquet(fs, name)
    rows = handle.metadata.row_group(0).num_rows
    start = time.monotonic()
    try:
        with pytest.raises(DataError) as err:
            read_piece(handle, Piece(RowGroup(name, 0, 0, rows), 0, rows))
    finally:
        release.set()
    assert time.monotonic() - start < 2 * RemoteTimeouts(0.5).deadline_s
    assert "the storage did not answer" in err.value.problem and name in err.value.problem


def test_an_endpoint_with_no_server_is_named_in_the_fix(monkeypatch) -> None:
    """AWS_ENDPOINT_URL at a port where nothing listens: refused at once, and the fix points
    at the endpoint, not at the path."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
                 "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_EC2_METADATA_DISABLED": "true", ENV_TIMEOUT: "1"}.items():
        monkeypatch.setenv(k, v)
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        load_meta("s3://bucket/ds")
    assert time.monotonic() - start < RemoteTimeouts(1).deadline_s
    assert "s3://bucket/ds/meta.json" in err.value.problem
    assert "AWS_ENDPOINT_URL" in err.value.fix and ENV_TIMEOUT in err.value.fix
