"""gemctl from a script: --version, -h on every command (with an example and the exit codes),
shell completion, JSON results on stdout, one spelling of the tracking option."""

from __future__ import annotations

import json

import pytest
import typer

from gemctl.main import app
from tests.cli.conftest import REPO, clean_exit


def _commands(group: typer.Typer, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [(*prefix, c.name or c.callback.__name__) for c in group.registered_commands]
    for sub in group.registered_groups:
        found += _commands(sub.typer_instance, (*prefix, sub.name))
    return found


COMMANDS = _commands(app)


def test_every_product_command_is_listed():
    names = {" ".join(c) for c in COMMANDS}
    assert {"validate", "submit", "profile", "plan", "profile-data", "sweep", "compare", "runs",
            "status", "logs", "stop", "ui", "data generate", "data movielens",
            "bench bbs"} <= names


def test_version(gemctl):
    for flag in ("--version", "-V"):
        result = gemctl(flag)
        clean_exit(result)
        assert result.output.startswith("gemctl ")


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_has_an_example_and_exit_codes(gemctl, command):
    result = gemctl(*command, "-h")
    clean_exit(result)
    text = " ".join(result.output.split())
    assert "Examples:" in text and f"$ gemctl {' '.join(command)}" in text
    assert "Exit codes: 0" in text


def test_shell_completion(gemctl, monkeypatch):
    # typer names the shell from the parent process; under make or CI that is sh, which it
    # has no script for, so the shell a user types in is given here
    monkeypatch.setattr("typer.completion._get_shell_name", lambda: "bash")
    result = gemctl("--show-completion")
    clean_exit(result)
    assert "complete" in result.output and "_GEMCTL_COMPLETE" in result.output


def test_tracking_option_has_one_spelling(gemctl):
    for command in (("submit",), ("sweep",), ("compare",), ("runs",), ("ui",)):
        text = gemctl(*command, "-h").output
        assert "--tracking-uri" in text, command
        assert "--backend-store-uri" not in text, command


def test_plan_json_on_stdout_and_out_file(gemctl, tmp_path):
    out = tmp_path / "plan.json"
    result = gemctl("plan", str(REPO / "recipes/demo.yaml"), "--world", "16",
                    "--gpus-per-host", "8", "--set", "parallel.hsdp_shard_group=8",
                    "--json", "--out", str(out))
    clean_exit(result)
    body = json.loads(result.stdout)
    assert body["groups"]["hsdp_shard"]["size"] == 8
    assert json.loads(out.read_text())["groups"] == body["groups"]


def test_runs_json(gemctl, sqlite_uri):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(sqlite_uri)
    run = client.create_run(client.create_experiment("e"), run_name="r1")
    client.log_metric(run.info.run_id, "eval/ne_ctr", 0.9)
    result = gemctl("runs", "--tracking-uri", sqlite_uri, "--json")
    clean_exit(result)
    body = json.loads(result.stdout)
    (row,) = body["runs"]
    assert row["run_id"] == run.info.run_id and row["ne_ctr"] == pytest.approx(0.9)


def test_validate_and_schema_json(gemctl):
    result = gemctl("validate", str(REPO / "recipes/demo.yaml"), "--json")
    clean_exit(result)
    assert json.loads(result.stdout)["recipe"]["name"] == "demo"
    # 350 steps of 2 x 256 over the 180,000 generated training samples
    assert json.loads(result.stdout)["planned_epochs"] == pytest.approx(350 * 512 / 180_000)
    spec = gemctl("validate", str(REPO / "recipes/ablations/attention.yaml"), "--json")
    clean_exit(spec)
    assert json.loads(spec.stdout)["past_one_epoch"] == {}
    long = gemctl("validate", str(REPO / "recipes/ablations/attention.yaml"), "--set",
                  "train.steps=700")
    clean_exit(long)
    assert "arms past one epoch" in long.stdout and "full 2.0" in long.stdout
    schema = gemctl("validate", "--schema", "--json")
    clean_exit(schema)
    body = json.loads(schema.stdout)
    assert body["title"] == "Recipe" and "train" in body["properties"]


def test_profile_data_json(gemctl, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = gemctl("profile-data", str(REPO / "recipes/demo.yaml"), "--set",
                    "data.synthetic.num_samples=2000", "--set", f"data.path={tmp_path / 'd'}",
                    "--world", "2", "--local-batch", "64", "--out", str(tmp_path / "p"), "--json")
    clean_exit(result)
    methods = {r["method"] for r in json.loads(result.stdout)["rows"]}
    assert {"none", "bbs", "global"} <= methods
