"""What the MLflow store refuses is refused before a run exists, and no run is left RUNNING:

- tag keys MLflow rejects ('[/]', an emoji, a path like 'a/../b') fail `gemctl validate` and
  `gemctl submit` at once, naming tracking.tags and the key; the recipe's rule (no MLflow
  import) agrees with MLflow's own validation on generated keys;
- RunTracker.start checks params, tags and names with MLflow's functions before it creates
  the run, and a failure after the run exists leaves it FAILED with the reason;
- a sweep's arm names that MLflow refuses in a key still name the parent's params.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import _validate_param_name, _validate_tag_name
from typer.testing import CliRunner

from gem_platform.errors import GemError, RecipeError
from gem_platform.tracking import RunTracker
from gem_platform.tracking_names import key_problem
from gemctl.main import app

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "recipes" / "demo.yaml")
# A refusal at load time: well under a second on a quiet machine, but a loaded 2-core CI machine
# has taken over a second for one; a key refused by the store instead would first generate the
# demo's 200,000 samples and open a run (which the m.db check below catches too).
REFUSED_AT_ONCE_S = 10.0
REFUSED = ["[/]", "\U0001f642", "a/../b", "/lead", "trail/", "", "x" * 251, "a\nb", "q'uote"]


def gemctl(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=True, prog_name="gemctl")


def mlflow_accepts(key: str) -> bool:
    try:
        _validate_tag_name(key)
        _validate_param_name(key)
    except MlflowException:
        return False
    return len(key) <= 250


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12) | st.text(alphabet="ab./ :-_[]\n\U0001f642", max_size=8))
@example("a//b")
@example("./a")
@example("abc\n")
def test_the_recipe_rule_is_mlflows(key):
    assert (key_problem(key) is None) == mlflow_accepts(key), key


@pytest.mark.parametrize("key", REFUSED, ids=repr)
def test_validate_and_submit_refuse_a_tag_key_mlflow_refuses(tmp_path, monkeypatch, key):
    monkeypatch.chdir(tmp_path)
    override = "tracking.tags=" + json.dumps({key: "x"})
    for command in (["validate", DEMO], ["submit", DEMO, "--local", "--tracking-uri",
                                         f"sqlite:///{tmp_path / 'm.db'}"]):
        start = time.perf_counter()
        result = gemctl(*command, "--set", override)
        assert time.perf_counter() - start < REFUSED_AT_ONCE_S
        assert result.exit_code == 2, (result.output, result.exception)
        assert "tracking.tags" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "m.db").exists()  # no store touched, no run


def test_start_refuses_before_creating_the_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    for params, tags in (({"bad[key]": 1}, {}), ({}, {"\U0001f642": "x"}), ({"a/../b": 1}, {})):
        with pytest.raises(RecipeError, match="MLflow would refuse"):
            RunTracker.start(uri, "names", "r", params, tags)
    c = MlflowClient(uri)
    assert c.search_runs([e.experiment_id for e in c.search_experiments()]) == []


def test_a_failure_after_the_run_exists_leaves_it_failed(tmp_path):
    """The run's dataset meta.json is unreadable: recording provenance fails after create_run;
    the run ends FAILED with the reason, not RUNNING."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text("{not json")
    with pytest.raises(Exception, match="Expecting property name"):
        RunTracker.start(uri, "names", "r", {"data.path": str(data)}, {})
    c = MlflowClient(uri)
    (run,) = c.search_runs([c.get_experiment_by_name("names").experiment_id])
    assert run.info.status == "FAILED"
    assert "JSONDecodeError" in run.data.tags["gem.failure_reason"]


def test_closed_on_error_keeps_a_status_set_inside(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tracker = RunTracker.start(uri, "names", "r", {}, {})
    with pytest.raises(KeyboardInterrupt), tracker.closed_on_error(interrupted="KILLED"):
        raise KeyboardInterrupt
    assert tracker.status() == "KILLED"
    tracker = RunTracker.start(uri, "names", "r2", {}, {})
    with pytest.raises(GemError), tracker.closed_on_error():
        tracker.finish(ok=True)
        raise GemError("after finishing")
    assert tracker.status() == "FINISHED"


def test_sweep_arm_names_mlflow_refuses_still_name_params(tmp_path, monkeypatch):
    from gem_platform.sweep.config import load_sweep
    from gem_platform.sweep.runner import _close, _open_parent
    from tests.sweep.test_spec import BASE

    monkeypatch.chdir(tmp_path)
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "s.yaml").write_text(
        "name: s\nbase: base.yaml\narms: {'a[1]': [train.steps=3], 'b=2,c': []}\n")
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    plan = load_sweep(tmp_path / "s.yaml", tracking_uri=uri)
    tracker, _, _, _ = _open_parent(plan, uri, new=True, echo=lambda line: None)
    params = MlflowClient(uri).get_run(tracker.run_id).data.params
    assert params["sweep.arm.a_1_"] == "train.steps=3" and params["sweep.arm.b_2_c"] == "(base)"
    _close(tracker, "FINISHED")
    (tmp_path / "long.yaml").write_text(f"name: s\nbase: base.yaml\narms: {{{'x' * 201}: []}}\n")
    with pytest.raises(GemError, match="at most 200"):
        load_sweep(tmp_path / "long.yaml")


@pytest.mark.slow
def test_an_interrupted_submit_ends_its_run_killed(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM, which gemctl turns into one) while the run trains: the run is
    closed KILLED with the reason before the interrupt reaches the user, never left RUNNING
    nor called FAILED."""
    import yaml

    from gem_platform.launch import submit
    from gem_platform.recipe import recipe_from_dict
    from tests.tiny_training import tiny_tree

    monkeypatch.chdir(tmp_path)
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=4)
    tree["tracking"]["uri"] = f"sqlite:///{tmp_path / 'm.db'}"
    recipe = recipe_from_dict(yaml.safe_load(yaml.safe_dump(tree)))

    def ctrl_c(event: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        submit(recipe, local=True, echo=ctrl_c)
    c = MlflowClient(tree["tracking"]["uri"])
    (run,) = c.search_runs([c.get_experiment_by_name("cli-test").experiment_id])
    assert run.info.status == "KILLED"
    assert run.data.tags["gem.failure_reason"] == "interrupted"


HOLD_A_RUN = """
import sys, time
import typer
from gemctl.errors import user_errors
from gem_platform.tracking import RunTracker

def hold() -> None:
    tracker = RunTracker.start(sys.argv[1], "hangup", "r", {}, {})
    with tracker.closed_on_error(interrupted="KILLED"):
        print(tracker.run_id, flush=True)
        time.sleep(120)

try:
    user_errors(hold)()  # as every gemctl command runs
except typer.Exit as done:
    sys.exit(done.exit_code)
"""


def _hold_a_run(uri: str, ignore_hangup: bool = False):
    """A gemctl-wrapped command holding a run open, started as a user would (under nohup:
    SIGHUP ignored); returns it and the run id once the run exists."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_RUN, uri], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        # Set either way: a test runner started under nohup passes SIGHUP ignored to children.
        preexec_fn=lambda: signal.signal(
            signal.SIGHUP, signal.SIG_IGN if ignore_hangup else signal.SIG_DFL))
    run_id = proc.stdout.readline().strip()
    assert run_id, proc.communicate(timeout=60)
    return proc, run_id


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_command_killed_by_a_signal_closes_its_run(tmp_path, sig):
    """A closed terminal (SIGHUP) or `kill` (SIGTERM) stops a command the way Ctrl-C does:
    the run it holds open ends KILLED, never left RUNNING by a process that just died."""
    import signal

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    proc, run_id = _hold_a_run(uri)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"


def test_nohup_keeps_a_command_running_after_a_hangup(tmp_path):
    import signal
    import time

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    proc, run_id = _hold_a_run(uri, ignore_hangup=True)
    proc.send_signal(signal.SIGHUP)
    time.sleep(2)
    assert proc.poll() is None and MlflowClient(uri).get_run(run_id).info.status == "RUNNING"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"


@pytest.mark.slow
def test_a_resume_stopped_before_it_trains_leaves_the_run_as_it_was(tmp_path, monkeypatch):
    """Ctrl-C while a resume of a FINISHED run starts up (before a step trains): the run stays
    FINISHED, the stopped attempt is recorded in a tag; the next resume still works."""
    import yaml

    from gem_platform.launch import submit
    from gem_platform.progress import StepProgress
    from gem_platform.recipe import recipe_from_dict
    from tests.tiny_training import tiny_tree

    monkeypatch.chdir(tmp_path)
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=4, checkpoint_every=2)
    tree["tracking"]["uri"] = uri = f"sqlite:///{tmp_path / 'm.db'}"
    recipe = recipe_from_dict(yaml.safe_load(yaml.safe_dump(tree)))
    run_id = submit(recipe, local=True, echo=lambda event: None).run_id
    steps: list[int] = []

    def ctrl_c(event: object) -> None:
        if isinstance(event, StepProgress):
            steps.append(event.step)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        submit(recipe, local=True, echo=ctrl_c, resume=run_id)
    assert steps == []
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["gem.resume_stopped"] == "interrupted before a step trained"
    assert submit(recipe, local=True, echo=lambda event: None, resume=run_id).run_id == run_id
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
