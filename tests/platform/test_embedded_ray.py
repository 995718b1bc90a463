"""An embedded run starts its own Ray, even where `ray start` left a cluster address behind.

Ray's ``ray.init()`` without an address joins the cluster named in
``$RAY_TMPDIR/ray/ray_current_cluster``; a user who once ran ``ray start`` (or a head node
sharing the machine) would otherwise have their local run borrowed by, or refused from, it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import free_port

PROBE = """
import ray
from gem_platform.launch import start_ray
start_ray(None, 1)
print("NODES", len(ray.nodes()), ray.cluster_resources().get("CPU"))
ray.shutdown()
"""


@pytest.mark.slow
def test_stale_cluster_address_is_not_joined() -> None:
    # Ray's unix socket paths must stay under 108 bytes: a short directory under /tmp.
    with tempfile.TemporaryDirectory(prefix="gr", dir="/tmp") as short:
        ray_tmp = Path(short)
        (ray_tmp / "ray").mkdir()
        (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}\n")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["RAY_TMPDIR"] = str(ray_tmp)
        proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                              text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NODES 1" in proc.stdout
