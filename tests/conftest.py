"""Shared fixtures: a real MLflow tracking server on 127.0.0.1 (sqlite backend), started once
per test session, and GPU-marker skipping."""

from __future__ import annotations

import os

# Without a GPU, Triton kernels run under the interpreter. This must hold before anything
# imports triton (torchrec/fbgemm do, at import), or kernels and their @jit helpers end up in
# different modes depending on which test module was collected first.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Ray Train's controller checks its workers every 2 s by default, so each run and each restart
# after a lost worker waits up to that long to be noticed; the tests' runs are seconds long.
# Set before any Ray starts here, so embedded Rays, test clusters and gemctl subprocesses
# (which inherit this environment) all poll at this rate.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    heaviest_modules_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def heaviest_modules_first(items: list[pytest.Item]) -> None:
    """Order the modules by how many ``slow`` tests (Ray, end-to-end training) each holds, most
    first, then by how many tests, most first; a module's tests stay together and in order.

    `make test` hands whole modules to two processes in this order (--dist loadfile
    --no-loadscope-reorder): the long modules start first and the many short ones fill in
    behind them, so both processes end close together. By test count alone (xdist's default)
    the long end-to-end modules, which hold few tests, came last, and one process could start
    a minutes-long module as the other ran out of work."""
    slow: Counter[Path] = Counter()
    count: Counter[Path] = Counter()
    for item in items:
        count[item.path] += 1
        slow[item.path] += "slow" in item.keywords
    items.sort(key=lambda item: (-slow[item.path], -count[item.path]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URI of a live MLflow server; it stores runs in sqlite and artifacts on local disk."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, cwd=root,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300  # ~8 s on an idle machine; far more under load
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()}")
        time.sleep(0.5)
    yield uri
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def run_gemctl(*args: str, cwd: Path, env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess, as a user would."""
    # An embedded Ray unless the test itself names a RAY_ADDRESS.
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    full_env = {**base, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "gemctl.main", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def gemctl_in_process(*args: str, cwd: Path, env: dict[str, str] | None = None
                      ) -> subprocess.CompletedProcess[str]:
    """Run the real gemctl app in this process (typer's CliRunner), in ``cwd`` with ``env``
    added, for commands whose test checks no behaviour of a process of their own (a command
    that reads runs or refuses an input): the same exit code, stdout and stderr as
    ``run_gemctl`` without a fresh interpreter's start-up. An exception that escapes the app
    is raised here, where a subprocess would have shown its traceback."""
    import signal

    from typer.testing import CliRunner

    from gemctl.main import app

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    here = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, list(args), env={"RAY_ADDRESS": None, **(env or {})},
                                    catch_exceptions=True, prog_name="gemctl")
    finally:
        os.chdir(here)
        for sig, handler in handlers.items():  # gemctl turns these into Ctrl-C for itself
            signal.signal(sig, handler)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout,
                                       result.stderr)


@pytest.fixture(autouse=True, scope="module")
def _ray_shut_down_after_each_module() -> Iterator[None]:
    """A module that started Ray in this process (a local run, a Tune sweep) does not leave it
    to the next: under pytest-xdist a worker's next module may need its own ray.init."""
    yield
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture(autouse=True, scope="module")
def _process_group_destroyed_after_each_module() -> Iterator[None]:
    """A single-process run keeps its default process group for the life of the process (as a
    Ray worker would); under pytest-xdist the worker's next module may create its own (a fake
    16-rank group, a gloo group), and torch allows one default group per process."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
