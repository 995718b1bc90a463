"""gemctl ui starts an MLflow server; when gemctl gets SIGTERM (a closed terminal, a CI timeout,
`kill`), the server and its workers stop too: nothing keeps listening, nothing is re-parented
to init."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from tests.conftest import free_port


def _listening(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_ui_server_dies_with_gemctl(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gemctl.main", "ui", "--port", str(port), "--tracking-uri",
         f"sqlite:///{tmp_path / 'mlflow.db'}"], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        # two server workers (MLflow starts four by default): still a supervisor with
        # several workers to outlive gemctl, at half the start-up on a small CI machine
        env={**os.environ, "MLFLOW_WORKERS": "2"})
    server: list[psutil.Process] = []
    try:
        deadline = time.time() + 240
        while not _listening(port):
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the MLflow UI did not start"
            time.sleep(0.2)
        server = psutil.Process(proc.pid).children(recursive=True)
        assert server
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
        gone, alive = psutil.wait_procs(server, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
        assert not _listening(port)
    finally:  # only what this test started
        for p in server:
            if p.is_running():
                p.kill()
        if proc.poll() is None:
            proc.kill()
