"""gemctl sweep --in-process refusals (the narrowed sweep itself runs in tests/sweep/
test_inprocess.py, on that module's sweep) and gemctl profile --trace, through the real CLI
in a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import gemctl_in_process, run_gemctl
from tests.sweep.test_inprocess import TRI_SPEC as SPEC
from tests.sweep.test_spec import BASE


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("sweepcli")
    (d / "base.yaml").write_text(BASE + "loader: {local_batch_size: 64, base_batch_size: 16}\n")
    (d / "tri.yaml").write_text(SPEC)
    return d


def test_unknown_arm_is_named(workdir):
    proc = gemctl_in_process("sweep", "tri.yaml", "--in-process", "--arms", "fp16", cwd=workdir)
    assert proc.returncode == 2
    assert "fp16" in proc.stderr and "fp32, bf16, wide" in proc.stderr


def test_in_process_refuses_tracking_options(workdir):
    proc = gemctl_in_process("sweep", "tri.yaml", "--in-process", "--tracking-uri", "sqlite:///x.db",
                      cwd=workdir)
    assert proc.returncode == 2 and "--in-process" in proc.stderr


@pytest.mark.slow
def test_profile_writes_a_chrome_trace(workdir):
    proc = run_gemctl("profile", "base.yaml", "--warmup", "2", "--active", "1", "--top", "5",
                      "--trace", "step.trace.json", "--out", "prof.json", cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = json.loads((workdir / "step.trace.json").read_text())
    assert trace["traceEvents"] and any(e.get("ph") == "X" for e in trace["traceEvents"])
    assert json.loads((workdir / "prof.json").read_text())["active_steps"] == 1
    assert "trace: step.trace.json" in proc.stdout


def test_profile_trace_folder_must_exist(workdir):
    proc = gemctl_in_process("profile", "base.yaml", "--trace", "nope/t.json", cwd=workdir)
    assert proc.returncode == 2 and "nope" in proc.stderr and "Traceback" not in proc.stderr
