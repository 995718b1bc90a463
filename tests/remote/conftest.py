"""A real Ray head (`ray start --head`, dashboard and Jobs server on 127.0.0.1) for the remote
submission tests.

The head runs in its own session with its own --temp-dir and ports, so other Ray clusters on
the machine are untouched: teardown signals only the processes of that session (`ray stop`
would end every Ray process of the user).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port


def _session_pids(sid: int) -> list[int]:
    """PIDs of live processes in session ``sid`` (read from /proc, Linux)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop_session(sid: int, grace_s: float = 5.0) -> None:
    _signal_all(_session_pids(sid), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.3)
    _signal_all(_session_pids(sid), signal.SIGKILL)


@dataclass(frozen=True)
class RayHead:
    """A running head: its Jobs API URL and the token its clients must present."""

    url: str
    token: str

    @property
    def env(self) -> dict[str, str]:
        """Environment for gemctl subprocesses that talk to this head."""
        return {"RAY_AUTH_TOKEN": self.token}

    def get(self, path: str) -> object:
        """GET a Jobs REST endpoint (JSON), as any HTTP client would."""
        req = urllib.request.Request(f"{self.url}{path}",
                                     headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read().decode())


def _wait_for_jobs_api(url: str, token: str, proc: subprocess.Popen, log: Path,
                       timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            req = urllib.request.Request(f"{url}/api/jobs/",
                                         headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=3) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline or (proc.poll() not in (None, 0)):
            raise RuntimeError(f"Ray head did not serve the Jobs API: {log.read_text()[-3000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    """A 2-CPU Ray head, Jobs API on 127.0.0.1, token authentication on; stopped (only it)
    at teardown."""
    root = tmp_path_factory.mktemp("rayhead")
    # Ray keeps unix sockets under --temp-dir; their paths must stay short (108 bytes).
    temp_dir = Path("/tmp") / f"gemray-{os.getpid()}-{free_port()}"
    url = f"http://127.0.0.1:{free_port()}"
    ports = {"--port": free_port(), "--dashboard-port": int(url.rsplit(":", 1)[1]),
             "--ray-client-server-port": free_port(), "--node-manager-port": free_port(),
             "--object-manager-port": free_port(), "--metrics-export-port": free_port(),
             "--dashboard-agent-listen-port": free_port(),
             "--dashboard-agent-grpc-port": free_port(), "--runtime-env-agent-port": free_port()}
    bin_dir = str(Path(sys.executable).parent)
    token = secrets.token_hex(32)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MLFLOW_TRACKING_URI",
                "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    cmd = [str(Path(bin_dir) / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1",
           "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--num-cpus", "2",
           "--num-gpus", "0", "--temp-dir", str(temp_dir), "--disable-usage-stats",
           "--object-store-memory", str(300 * 1024 * 1024),
           *[str(x) for kv in ports.items() for x in kv]]
    log = root / "ray-start.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root,
                                start_new_session=True)
    try:
        _wait_for_jobs_api(url, token, proc, log, timeout_s=180)
        yield RayHead(url, token)
    finally:
        _stop_session(proc.pid)
        proc.wait(timeout=5)
        subprocess.run(["rm", "-rf", str(temp_dir)], check=False)
