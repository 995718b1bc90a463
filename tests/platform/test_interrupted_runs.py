"""A run stopped by Ctrl-C or SIGTERM (a KeyboardInterrupt in gemctl) is recorded KILLED even
where cleanup code the interrupt unwound through raised an error of its own: the interrupt then
survives only as that error's context, and a check of the error's type alone recorded the run
FAILED."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from gem_platform.interrupts import interrupt_in
from gem_platform.progress import StepProgress
from gem_platform.recipe import recipe_from_dict
from gem_platform.tracking import RunTracker
from tests.tiny_training import tiny_tree


class DisplayGone(OSError):
    """What a progress display's cleanup raises when its terminal went away."""


def _replaced_interrupt() -> None:
    """An interrupt whose unwinding cleanup raises: the error that escapes is DisplayGone."""
    try:
        raise KeyboardInterrupt("signal 15")
    finally:
        raise DisplayGone("the progress display's terminal is gone")  # noqa: B012


def test_the_interrupt_is_found_behind_errors_raised_while_it_unwound():
    with pytest.raises(DisplayGone) as replaced:
        _replaced_interrupt()
    assert isinstance(interrupt_in(replaced.value), KeyboardInterrupt)
    try:
        try:
            _replaced_interrupt()
        except DisplayGone as err:
            raise RuntimeError("wrapped") from err
    except RuntimeError as wrapped:
        assert isinstance(interrupt_in(wrapped), KeyboardInterrupt)
    exit_ = SystemExit(143)
    assert interrupt_in(exit_) is exit_
    plain = ValueError("no interrupt")
    plain.__context__ = TypeError("an earlier failure")
    assert interrupt_in(plain) is None
    looped = ValueError("a")
    looped.__context__ = TypeError("b")
    looped.__context__.__context__ = looped
    assert interrupt_in(looped) is None


def test_the_run_tracker_closes_such_a_run_killed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tracker = RunTracker.start(uri, "interrupts", None, {"a": 1})
    with pytest.raises(DisplayGone), tracker.closed_on_error(interrupted="KILLED"):
        _replaced_interrupt()
    run = MlflowClient(uri).get_run(tracker.run_id)
    assert run.info.status == "KILLED" and run.data.tags["gem.failure_reason"] == "interrupted"
    failing = RunTracker.start(uri, "interrupts", None, {"a": 1})
    with pytest.raises(DisplayGone), failing.closed_on_error(interrupted="KILLED"):
        raise DisplayGone("a failure no interrupt led to")
    assert MlflowClient(uri).get_run(failing.run_id).info.status == "FAILED"


@pytest.mark.slow
def test_a_local_run_interrupted_behind_a_display_error_is_killed(tmp_path, monkeypatch):
    """The real local run: the interrupt lands while step 3's progress is shown, and the
    display's cleanup fails as it unwinds. The run is KILLED and the interrupt, not the
    display's error, is what submit raises (gemctl: exit 130, 'Interrupted.')."""
    from gem_platform.launch import submit

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tree = tiny_tree(tmp_path / "data", steps=5)
    tree["tracking"] = {"uri": uri, "experiment": "interrupted"}

    def echo(event: object) -> None:
        if isinstance(event, StepProgress) and event.step == 3:
            _replaced_interrupt()

    with pytest.raises(KeyboardInterrupt):
        submit(recipe_from_dict(tree), local=True, echo=echo)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("interrupted").experiment_id])
    assert run.info.status == "KILLED"
    assert run.data.tags["gem.failure_reason"] == "interrupted"
    # step 3's progress is shown before its metrics are logged: the record ends at step 2
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]
