"""The real CLI in a subprocess: the full submit path on Ray with 2 workers recorded in a live
MLflow server, the in-process path, and every bad input (clear message, exit code != 0, no
traceback, no orphan run; inputs refused before anything starts are given to the app in this
process). What a user sees while a run trains: progress with elapsed time and ETA, no library
noise, no ANSI codes in a log, no credentials."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import free_port, gemctl_in_process, run_gemctl
from tests.tiny_training import TINY


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding tiny.yaml, whose data.path is relative (as in recipes/demo.yaml): every
    command here runs in this folder, and Ray Train workers, which start in run folders of
    their own, must still find the dataset."""
    d = tmp_path_factory.mktemp("cli")
    (d / "tiny.yaml").write_text(TINY.format(data="data"))
    return d


def no_traceback(proc) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr


# What libraries print that a user must not see (it goes to gem_runs/logs/ instead).
NOISE = ("PlacementGroupCleaner", "Failed to query Ray Train Controller", "INFO mlflow",
         "Successfully loaded", "DeprecationWarning", "Trial status", "\x1b[")


def quiet_and_plain(text: str) -> None:
    for noise in NOISE:
        assert noise not in text, (noise, text[-3000:])


def runs_in(uri: str, experiment: str) -> list:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


def test_validate_ok(workdir):
    proc = gemctl_in_process("validate", "tiny.yaml", "--set", "train.steps=3", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert "is valid" in proc.stdout


@pytest.mark.parametrize("content, overrides, needle", [
    ("model: {d_model: 16\n", [], "not valid YAML"),
    (None, ["--set", "model.atention=full"], "model.atention: unknown field"),
    (None, ["--set", "train.steps=-1"], "train.steps"),
    (None, ["--set", "model.attention=sparse"], "model.attention"),
    (None, ["--set", "train.steps"], "has no '='"),
])
def test_bad_recipe_inputs(workdir, content, overrides, needle):
    path = "tiny.yaml"
    if content is not None:
        (workdir / "bad.yaml").write_text(content)
        path = "bad.yaml"
    for command in ("validate", "submit"):
        proc = gemctl_in_process(command, path, *overrides, cwd=workdir)
        assert proc.returncode == 2
        assert needle in proc.stderr
        no_traceback(proc)
    assert not (workdir / "mlflow.db").exists()


def test_missing_recipe_file(workdir):
    proc = gemctl_in_process("submit", "nope.yaml", cwd=workdir)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    no_traceback(proc)


def test_missing_data_path_opens_no_run(workdir, mlflow_server):
    proc = gemctl_in_process("submit", "tiny.yaml", "--set", "data.source=parquet",
                      "--set", f"data.path={workdir / 'absent'}", cwd=workdir,
                      env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert proc.returncode == 2
    assert "absent" in proc.stderr
    no_traceback(proc)
    assert runs_in(mlflow_server, "cli-test-missing") == []


def test_unreachable_ray_address_fails_fast(workdir):
    start = time.time()
    proc = run_gemctl("submit", "tiny.yaml", "--address", f"ray://127.0.0.1:{free_port()}",
                      cwd=workdir)
    assert proc.returncode == 2
    assert "unreachable" in proc.stderr and "--address" in proc.stderr
    no_traceback(proc)
    assert time.time() - start < 60
    assert not (workdir / "mlflow.db").exists()


def test_unreachable_tracking_server(workdir):
    proc = gemctl_in_process("submit", "tiny.yaml", cwd=workdir,
                      env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"})
    assert proc.returncode == 2
    assert "MLflow tracking server" in proc.stderr and "unreachable" in proc.stderr
    no_traceback(proc)


def test_world_size_the_recipe_cannot_use(workdir):
    proc = gemctl_in_process("submit", "tiny.yaml", "--set", "parallel.workers=64", cwd=workdir)
    assert proc.returncode == 2
    assert "parallel.workers=64" in proc.stderr
    no_traceback(proc)


def test_more_workers_than_an_embedded_ray_can_host(workdir):
    """Refused at once, before a run or a Ray exists, instead of starting every worker on
    this machine and saying nothing for minutes."""
    workers = 4 * (os.cpu_count() or 1) + 1
    samples = max(2400, 200 * workers)  # enough for a full local batch on every rank
    start = time.time()
    proc = run_gemctl("submit", "tiny.yaml", "--set", f"parallel.workers={workers}",
                      "--set", f"data.synthetic.num_samples={samples}", cwd=workdir)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"parallel.workers={workers}" in proc.stderr and "--address" in proc.stderr
    no_traceback(proc)
    assert time.time() - start < 90
    assert not (workdir / "mlflow.db").exists()


def test_failure_after_start_marks_run_failed(workdir, mlflow_server):
    """A run that breaks while training ends FAILED with the reason, never RUNNING."""
    proc = run_gemctl("submit", "tiny.yaml", "--local", "--set", "train.device=cuda",
                      "--set", "tracking.experiment=cli-test-failed", cwd=workdir,
                      env={"MLFLOW_TRACKING_URI": mlflow_server})
    if proc.returncode == 0:
        pytest.skip("this machine has CUDA")
    assert proc.returncode == 1
    no_traceback(proc)
    (run,) = runs_in(mlflow_server, "cli-test-failed")
    assert run.info.status == "FAILED"
    assert "CUDA" in run.data.tags["gem.failure_reason"]


def _check_run(uri: str, run, workers: int) -> None:
    client = MlflowClient(uri)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["model.attention"] == "block64"
    assert params["parallel.workers"] == "2" and params["train.steps"] == "6"
    metrics = run.data.metrics
    for key in ("eval/ne_ctr", "eval/auc_ctr", "eval/ne_cvr", "eval/auc_cvr", "perf/qps",
                "perf/mfu_e2e", "perf/mfu_local", "perf/scaling_ratio", "planted/auc_ctr",
                "balance/padding_waste_mean", "balance/straggler_overhead_mean"):
        assert key in metrics, key
    assert metrics["perf/world_size"] == workers
    assert 0.0 < metrics["eval/auc_ctr"] < 1.0 and metrics["eval/ne_ctr"] > 0
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [2, 4, 6]
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"recipe.yaml", "summary.json", "placement.json"} <= names
    summary = json.loads(Path(client.download_artifacts(run.info.run_id, "summary.json"))
                         .read_text())
    assert summary["eval/auc_ctr"] == pytest.approx(metrics["eval/auc_ctr"])


@pytest.mark.slow
def test_submit_on_ray_with_two_workers(workdir, mlflow_server):
    """With the off-the-shelf model variant: neither the driver nor a Ray worker imports
    gem_bench by name; both find it through its entry point (ours trains on Ray Train in the
    placement and object-storage tests)."""
    proc = run_gemctl("submit", "tiny.yaml", "--json", "--set", "model.kernel=baseline",
                      cwd=workdir, env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # stdout holds the result only; progress is on stderr
    assert re.search(r"step 6/6 .* elapsed \d+:\d\d +eta ", proc.stderr)
    quiet_and_plain(proc.stdout + proc.stderr)
    (run,) = runs_in(mlflow_server, "cli-test")
    assert result["run_id"] == run.info.run_id and result["summary"]["eval/auc_ctr"] > 0
    assert Path(workdir / result["log"]).exists()  # library output kept for a post-mortem
    _check_run(mlflow_server, run, workers=2)
    assert run.data.tags["gem.mode"] == "ray"
    assert run.data.params["model.kernel"] == "baseline"


@pytest.mark.slow
def test_submit_local_in_process(workdir, mlflow_server):
    """With a password in the tracking URI: recorded and printed nowhere."""
    with_password = mlflow_server.replace("http://", "http://alice:s3cret@")
    proc = run_gemctl("submit", "tiny.yaml", "--local", "--set",
                      "tracking.experiment=cli-test-local", "--set",
                      f"tracking.uri={with_password}", cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval auc" in proc.stdout and "wall time" in proc.stdout
    assert re.search(r"step 6/6 .* elapsed \d+:\d\d +eta ", proc.stdout)
    quiet_and_plain(proc.stdout + proc.stderr)
    assert "s3cret" not in proc.stdout + proc.stderr and "alice:***@" in proc.stdout
    (run,) = runs_in(mlflow_server, "cli-test-local")
    _check_run(mlflow_server, run, workers=1)
    assert run.data.tags["gem.mode"] == "local"
    assert run.data.params["tracking.uri"] == mlflow_server.replace("http://", "http://alice:***@")
    recipe = Path(MlflowClient(mlflow_server).download_artifacts(run.info.run_id, "recipe.yaml"))
    assert "s3cret" not in recipe.read_text() and "alice:***@" in recipe.read_text()
