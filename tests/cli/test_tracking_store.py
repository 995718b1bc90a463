"""The MLflow store as users meet it: first runs racing on a brand-new sqlite file, a store that
is not a database, and credentials in a tracking URI (never recorded, never printed)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gem_platform.errors import TrackingError
from gem_platform.net import redact
from gem_platform.tracking import RunTracker
from tests.cli.conftest import REPO, clean_exit

RACER = textwrap.dedent("""
    import os, sys, time
    sys.path[:0] = [{platform!r}]
    go, uri, name = sys.argv[1:4]
    while not os.path.exists(go):
        time.sleep(0.005)
    from gem_platform.tracking import RunTracker
    tracker = RunTracker.start(uri, "race", name, {{"a": 1}})
    tracker.finish(ok=True)
    print("ok", tracker.run_id)
""").format(platform=str(REPO / "platform"))


def test_first_runs_race_on_a_new_sqlite_store(tmp_path):
    """Four processes open the same fresh store at the same moment: all of them record."""
    uri = f"sqlite:///{tmp_path / 'fresh.db'}"
    go = tmp_path / "go"
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    procs = [subprocess.Popen([sys.executable, str(script), str(go), uri, f"r{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    time.sleep(3)  # all four imported and waiting
    go.touch()
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err[-3000:]
        assert out.startswith("ok ")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("race")
    assert len(client.search_runs([exp.experiment_id])) == 4


def test_a_file_that_is_not_a_store(tmp_path, gemctl):
    bad = tmp_path / "mlflow.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    uri = f"sqlite:///{bad}"
    with pytest.raises(TrackingError) as err:
        RunTracker.start(uri, "x", None, {})
    assert str(bad) in err.value.problem
    result = gemctl("runs", "--tracking-uri", uri)
    clean_exit(result, 2)
    assert "can't be used" in result.stderr


def test_a_folder_as_store(tmp_path, gemctl):
    result = gemctl("runs", "--tracking-uri", f"sqlite:///{tmp_path}")
    clean_exit(result, 2)
    assert "is a directory" in result.stderr


@pytest.mark.parametrize("text, secret", [
    ("http://alice:secret@127.0.0.1:5000", "secret"),
    ("https://tok3n@mlflow.example.com/api", "tok3n"),
    ("ray://bob:hunter2@head:10001", "hunter2"),
    ("s3://bucket/key?X-Amz-Signature=abc123&x=1", "abc123"),
    ("postgresql://u:p@ss@db:5432/mlflow", "p@ss"),
    ("error: http://a:zz9@h:1 is unreachable", "zz9"),
    # Passwords pasted without percent-encoding: '?' and '#' would start a query or fragment.
    ("MLflow tracking URI 'http://u:pa?ss@127.0.0.1:1' is malformed", "pa?ss"),
    ("http://u:pa#ss@host:5000/x", "pa#ss"),
    ("postgresql://u:a?b@c#d@db:5432/ml", "a?b@c#d"),
])
def test_redact(text, secret):
    masked = redact(text)
    assert secret not in masked and "***" in masked


def test_a_malformed_uri_never_shows_its_password():
    """A password pasted with an unencoded '/' ends the URL's authority early: the error about
    the malformed URI shows the host, not a piece of the password."""
    from gem_platform.errors import GemError
    from gem_platform.net import parse_url

    with pytest.raises(GemError) as err:
        parse_url("http://u:pa/ss@127.0.0.1:1", "MLflow tracking URI", "Fix it.")
    text = str(err.value)
    assert "pa/ss" not in text and "ss@" not in text and "pa" not in text.split("malformed")[0]
    assert "***@127.0.0.1:1" in text


def test_redact_leaves_plain_text_alone():
    for text in ("sqlite:////tmp/mlflow.db", "http://127.0.0.1:5000", "train.lr=0.1",
                 "a@b.com", "x=1&y=2", "http://h:5000/#/runs/1 by a@b.com",
                 "http://h:5000/x?by=a@b.com"):
        assert redact(text) == text


def test_tracker_records_no_credentials(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tracker = RunTracker.start(uri, "creds", "run", {
        "tracking.uri": "http://alice:secret@127.0.0.1:5000", "data.path": "s3://k?token=q7xtok"},
        tags={"note": "ray://bob:hunter2@head:10001"})
    tracker.log_text("tracking:\n  uri: http://alice:secret@127.0.0.1:5000\n", "recipe.yaml")
    tracker.log_json({"address": "ray://bob:hunter2@head:10001"}, "summary.json")
    tracker.finish(ok=False, reason="could not reach http://alice:secret@127.0.0.1:5000")
    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    recorded = json.dumps([run.data.params, run.data.tags])
    for name in ("recipe.yaml", "summary.json"):
        recorded += Path(client.download_artifacts(tracker.run_id, name, str(tmp_path))
                         ).read_text()
    for secret in ("secret", "hunter2", "q7xtok"):
        assert secret not in recorded
    assert run.data.params["tracking.uri"] == "http://alice:***@127.0.0.1:5000"


def test_store_failures_anywhere_are_clear_errors(tmp_path, gemctl):
    """A store error raised past the tracker (MLflow refusing the search filter a quote in
    the sweep id makes) still ends as one paragraph and exit 2."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    MlflowClient(uri).create_experiment("e")
    result = gemctl("runs", "--tracking-uri", uri, "--sweep", "x'y")
    clean_exit(result, 2)
    assert "can't be used" in result.stderr and "MlflowException" in result.stderr


def test_mlflow_errors_past_every_wrapper_are_clear(tmp_path, gemctl):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    MlflowClient(uri).create_experiment("e")
    result = gemctl("compare", "x'y", "--tracking-uri", uri)
    clean_exit(result, 2)
    assert "MLflow refused the request" in result.stderr and "x'y" in result.stderr
