"""Checkpoints, resume and failure recovery: an interrupted and resumed run equals an
uninterrupted one, its step metrics have no gap or repeat, and a diverging run stops with the
step and the tensor. (A killed Ray worker replaced from the last checkpoint: in
tests/deploy/test_object_storage.py, on that module's Ray run.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from gem_platform.checkpoint.store import Stateful
from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train
from tests.conftest import gemctl_in_process
from tests.resume import crash_and_resume, losses_of


def test_resumed_run_equals_uninterrupted(tiny_recipe, monkeypatch):
    d, tree = tiny_recipe
    monkeypatch.chdir(d)
    recipe = recipe_from_dict({**tree, "train": {**tree["train"], "perf_warmup_steps": 2}})

    full, straight = losses_of(recipe)
    # QPS and MFU leave out each process's first 2 steps (compilation, autotuning)
    assert straight["perf/steps_measured"] == 4
    assert straight["perf/qps"] > 0 and straight["perf/qps_all_steps"] > 0

    # crash after step 5: past the step-4 checkpoint, before the next one
    logged, summary = crash_and_resume(recipe, d / "ckpts", every=2, keep=2, crash_after=5,
                                       expect_checkpoint=4)
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in full] == [1, 2, 3, 4, 5, 6]
    for (_, a), (_, b) in zip(logged, full, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert summary["train/final_loss"] == pytest.approx(full[-1][1], rel=1e-5)
    # steps 3-4 measured before the crash (kept in the checkpoint); the resumed process warms
    # up on step 5 (at most all but one of its steps) and measures step 6
    assert summary["perf/steps_measured"] == 3
    # only the newest two checkpoints are kept
    assert sorted(p.name for p in (d / "ckpts").glob("step_*")) == ["step_00000002",
                                                                    "step_00000004"]


def test_divergence_stops_with_step_and_tensor(tiny_recipe, monkeypatch):
    d, tree = tiny_recipe
    monkeypatch.chdir(d)
    recipe = recipe_from_dict({**tree, "train": {**tree["train"], "steps": 30}})
    # An lr no recipe may hold (validation caps it), set past validation to force divergence.
    recipe = recipe.model_copy(update={"train": recipe.train.model_copy(
        update={"lr": 1e12, "grad_clip": None})})
    from gem_platform.train.loop import TrainingDiverged

    with pytest.raises(TrainingDiverged, match=r"diverged at step \d+: the (model's logits|loss"
                                               r"|gradient of .+) became NaN/inf") as err:
        train(recipe, echo=lambda _: None)
    # no checkpoint store: the message must not promise a checkpoint
    assert "no checkpoint was saved (checkpointing is off)" in str(err.value)


def test_checkpoint_of_other_code_is_refused_with_the_reason(tmp_path, monkeypatch):
    # Extras of a class this code no longer has (a checkpoint of another code version).
    module = tmp_path / "gone_extras.py"
    module.write_text("class Extras:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gone_extras

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    Stateful(model, [opt]).save(tmp_path / "ckpt", 1, 0, gone_extras.Extras())
    del sys.modules["gone_extras"]
    module.unlink()
    with pytest.raises(RuntimeError, match=r"written by another version of the training code "
                                           r"and can't be read by this one \(No module named "
                                           r"'gone_extras'\)"):
        Stateful(model, [opt]).load(tmp_path / "ckpt", 0)


def _history_steps(uri: str, run_id: str) -> list[int]:
    return [m.step for m in MlflowClient(uri).get_metric_history(run_id, "train/loss")]


def _wait_for_step(uri: str, experiment: str, step: int, running: Callable[[], bool],
                   timeout: float = 300):
    client = MlflowClient(uri)
    deadline = time.time() + timeout
    while time.time() < deadline and running():
        exp = client.get_experiment_by_name(experiment)
        if exp:
            runs = client.search_runs([exp.experiment_id])
            if runs and any(s >= step for s in _history_steps(uri, runs[0].info.run_id)):
                return runs[0]
        time.sleep(0.2)
    return None


def _start(args, cwd, uri):
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "gemctl.main", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _write_recipe(d: Path, tree: dict, **train) -> Path:
    t = {**tree, "train": {**tree["train"], **train}}
    p = d / "ckpt.yaml"
    p.write_text(yaml.safe_dump(t))
    return p


@pytest.mark.slow
def test_resume_continues_the_same_mlflow_run(tiny_recipe, mlflow_server):
    d, tree = tiny_recipe
    _write_recipe(d, tree, steps=14, log_every=1, checkpoint_every=2)
    exp = "ckpt-resume"
    args = ["submit", "ckpt.yaml", "--local", "--set", f"tracking.experiment={exp}"]
    proc = _start(args, d, mlflow_server)
    run = _wait_for_step(mlflow_server, exp, 4, lambda: proc.poll() is None)
    if run is None or proc.poll() is not None:
        proc.kill()
        pytest.skip("the run finished before it could be interrupted")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in out
    client = MlflowClient(mlflow_server)
    stopped = client.get_run(run.info.run_id)
    # on failure: why the run was closed as it was, and what the command printed
    assert stopped.info.status == "KILLED", (stopped.data.tags.get("gem.failure_reason"),
                                             out[-3000:])

    resumed = subprocess.run([sys.executable, "-m", "gemctl.main", *args, "--resume",
                              run.info.run_id], cwd=d, capture_output=True, text=True,
                             env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_server},
                             timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from step" in resumed.stdout
    final = client.get_run(run.info.run_id)
    assert final.info.status == "FINISHED"
    assert _history_steps(mlflow_server, run.info.run_id) == list(range(1, 15))
    exp_id = client.get_experiment_by_name(exp).experiment_id
    assert len(client.search_runs([exp_id])) == 1  # no duplicate run


def test_resume_with_another_recipe_is_refused(tiny_recipe, mlflow_server):
    d, tree = tiny_recipe
    _write_recipe(d, tree)
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("ckpt-refuse") or client.create_experiment("ckpt-refuse")
    exp_id = exp if isinstance(exp, str) else exp.experiment_id
    run = client.create_run(exp_id)
    client.log_param(run.info.run_id, "train.steps", "999")
    proc = gemctl_in_process("submit", "ckpt.yaml", "--local", "--resume", run.info.run_id,
                             cwd=d, env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert proc.returncode == 2
    assert "different recipe" in proc.stderr and "train.steps" in proc.stderr
