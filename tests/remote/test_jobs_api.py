"""Remote submission against a real Ray head on 127.0.0.1: jobs run gemctl from the uploaded
project, `gemctl logs/status/stop` follow and control them, bad addresses fail in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, run_gemctl
from tests.remote.conftest import RayHead

pytestmark = pytest.mark.slow


def no_traceback(proc) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr


def submit_via_api(head: RayHead, args: list[str], env_vars: dict[str, str] | None = None
                   ) -> str:
    """gem_platform.remote.submit_job, called the way gemctl sweep calls it."""
    code = ("import json, sys; from gem_platform.remote import submit_job; "
            "a = json.loads(sys.argv[1]); "
            "print(submit_job(a['args'], a['url'], working_dir=a['root'], env_vars=a['env']))")
    payload = json.dumps({"args": args, "url": head.url, "root": str(REPO),
                          "env": env_vars or {}})
    proc = subprocess.run([sys.executable, "-c", code, payload], capture_output=True,
                          text=True, env={**os.environ, **head.env}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def job_status(head: RayHead, job: str) -> str:
    return head.get(f"/api/jobs/{job}")["status"]


TINY = ["train.steps=2", "train.log_every=1", "train.warmup_steps=1",
        "loader.local_batch_size=64", "data.synthetic.num_samples=1200",
        "data.synthetic.num_users=200", "data.synthetic.num_items=200"]


@dataclass(frozen=True)
class TrainingJob:
    job: str
    store: str
    sets: list[str]
    submit: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def training_job(ray_head: RayHead, tmp_path_factory: pytest.TempPathFactory) -> TrainingJob:
    """A tiny training run submitted with the CLI; it trains on the cluster while the other
    tests run, and the last test checks what it did."""
    tmp = tmp_path_factory.mktemp("remote-train")
    store = f"sqlite:///{tmp / 'mlflow.db'}"
    sets = [*TINY, f"data.path={tmp / 'data'}"]
    sub = run_gemctl("submit", "recipes/demo.yaml", "--local", "--address", ray_head.url,
                     *[a for s in sets for a in ("--set", s)], cwd=REPO,
                     env={"MLFLOW_TRACKING_URI": store, **ray_head.env})
    no_traceback(sub)
    assert sub.returncode == 0, sub.stderr
    job = next(w for w in sub.stdout.split() if w.startswith("gem-demo-"))
    return TrainingJob(job, store, sets, sub)


def test_validate_job_succeeds_and_is_followed(ray_head: RayHead,
                                               training_job: TrainingJob) -> None:
    head, env = ray_head, ray_head.env  # training_job: started first, checked last
    ok = submit_via_api(head, ["validate", "recipes/demo.yaml", "--set", "train.steps=7"],
                        env_vars={"GEM_TEST_MARK": "1"})
    # The second job reuses the first one's uploaded packages once its environment exists.
    deadline = time.monotonic() + 120
    while job_status(head, ok) == "PENDING" and time.monotonic() < deadline:
        time.sleep(0.5)
    bad = submit_via_api(head, ["validate", "recipes/no-such-recipe.yaml"])
    assert ok.startswith("gem-validate-") and ok != bad

    follow = run_gemctl("logs", ok, "--follow", "--address", head.url, cwd=REPO, env=env,
                        timeout=180)
    no_traceback(follow)
    assert follow.returncode == 0, (follow.stdout + follow.stderr
                                    + json.dumps(head.get(f"/api/jobs/{ok}"), indent=1))
    assert "recipe 'demo' is valid" in follow.stdout
    assert "SUCCEEDED" in follow.stdout

    status = run_gemctl("status", ok, "--address", head.url, cwd=REPO, env=env)
    assert status.returncode == 0 and "SUCCEEDED" in status.stdout
    assert "python -m gemctl.main validate recipes/demo.yaml" in status.stdout

    plain = run_gemctl("logs", ok, "--address", head.url, cwd=REPO, env=env)
    assert plain.returncode == 0 and "is valid" in plain.stdout

    # The cluster ran it from the uploaded copy, with the packages as py_modules.
    runtime_env = head.get(f"/api/jobs/{ok}")["runtime_env"]
    assert runtime_env["env_vars"]["GEM_TEST_MARK"] == "1"
    assert runtime_env["working_dir"].startswith("gcs://")
    assert len(runtime_env["py_modules"]) == 3

    failed = run_gemctl("logs", bad, "--follow", "--address", head.url, cwd=REPO, env=env,
                        timeout=180)
    assert failed.returncode == 1
    assert "no-such-recipe.yaml" in failed.stdout and "FAILED" in failed.stdout

    listing = run_gemctl("status", "--address", head.url, cwd=REPO, env=env)
    assert listing.returncode == 0
    assert ok[:20] in listing.stdout

    as_json = run_gemctl("status", ok, "--address", head.url, "--json", cwd=REPO, env=env)
    assert as_json.returncode == 0, as_json.stderr
    view = json.loads(as_json.stdout)
    assert view["job_id"] == ok and view["status"] == "SUCCEEDED" and view["terminal"]
    jobs = json.loads(run_gemctl("status", "--address", head.url, "--json", cwd=REPO,
                                 env=env).stdout)["jobs"]
    assert ok in {j["job_id"] for j in jobs}


def test_stop_a_running_job(ray_head: RayHead) -> None:
    head = ray_head
    job = submit_via_api(head, ["ui", "--port", str(free_port())])  # runs until stopped
    deadline = time.monotonic() + 120
    while job_status(head, job) == "PENDING":
        assert time.monotonic() < deadline, "job never started"
        time.sleep(0.5)
    stop = run_gemctl("stop", job, "--address", head.url, cwd=REPO, env=head.env, timeout=120)
    no_traceback(stop)
    assert stop.returncode == 0 and "STOPPED" in stop.stdout, stop.stdout + stop.stderr
    assert job_status(head, job) == "STOPPED"


def test_unknown_job_is_a_clear_error(ray_head: RayHead) -> None:
    for cmd in (["status", "gem-nope"], ["logs", "gem-nope"], ["stop", "gem-nope"]):
        proc = run_gemctl(*cmd, "--address", ray_head.url, cwd=REPO, env=ray_head.env)
        no_traceback(proc)
        assert proc.returncode == 2
        assert "No job 'gem-nope'" in proc.stderr


def test_unreachable_address_fails_in_seconds() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    for cmd in (["submit", "recipes/demo.yaml"], ["status", "gem-x"], ["logs", "gem-x"],
                ["stop", "gem-x"]):
        start = time.monotonic()
        proc = run_gemctl(*cmd, "--address", dead, cwd=REPO, timeout=60)
        no_traceback(proc)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "unreachable" in proc.stderr and dead in proc.stderr
        assert time.monotonic() - start < 30


def test_submit_reads_a_jobs_address_from_ray_address() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proc = run_gemctl("submit", "recipes/demo.yaml", cwd=REPO, env={"RAY_ADDRESS": dead})
    no_traceback(proc)
    assert proc.returncode == 2 and "Ray Jobs server" in proc.stderr


def test_missing_or_wrong_token_is_a_clear_error(ray_head: RayHead, tmp_path: Path) -> None:
    no_token = {"RAY_AUTH_TOKEN": "", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")}
    proc = run_gemctl("status", "--address", ray_head.url, cwd=REPO, env=no_token)
    no_traceback(proc)
    assert proc.returncode == 2 and "requires an authentication token" in proc.stderr
    proc = run_gemctl("status", "--address", ray_head.url, cwd=REPO,
                      env={"RAY_AUTH_TOKEN": "0" * 64})
    no_traceback(proc)
    assert proc.returncode == 2 and "rejected the token" in proc.stderr


def test_status_rejects_a_gcs_address() -> None:
    proc = run_gemctl("status", "--address", "127.0.0.1:6379", cwd=REPO)
    no_traceback(proc)
    assert proc.returncode == 2 and "not a Ray Jobs API address" in proc.stderr


def test_cli_submit_trains_on_the_cluster(ray_head: RayHead, training_job: TrainingJob
                                          ) -> None:
    head, job, sets = ray_head, training_job.job, training_job.sets
    assert "submitted" in training_job.submit.stdout
    assert f"gemctl logs {job} --follow" in training_job.submit.stdout

    info = head.get(f"/api/jobs/{job}")
    assert info["runtime_env"]["env_vars"]["MLFLOW_TRACKING_URI"] == training_job.store
    assert info["entrypoint"] == ("python -m gemctl.main submit recipes/demo.yaml "
                                  + " ".join(f"--set {s}" for s in sets) + " --local")

    follow = run_gemctl("logs", job, "--follow", "--address", head.url, cwd=REPO,
                        env=head.env, timeout=300)
    no_traceback(follow)
    assert follow.returncode == 0, follow.stdout[-3000:] + follow.stderr
    assert "step 2/2" in follow.stdout and "SUCCEEDED" in follow.stdout

    # The job recorded its run in the tracking store it was given.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(training_job.store)
    (run,) = client.search_runs([client.get_experiment_by_name("gem-demo").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["gem.mode"] == "local"
    assert "eval/ne_ctr" in run.data.metrics
