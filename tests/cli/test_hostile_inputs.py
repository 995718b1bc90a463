"""Inputs a careful (or hostile) user tries: markup in names, paths and overrides, recipes whose
data is on another machine, directories, out-of-range cluster sizes, YAML bombs. Each gets a
clear message and exit code 2, or works; never a traceback."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.cli.conftest import REPO, clean_exit

RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml"))
SWEEPS = sorted((REPO / "recipes" / "ablations").glob("*.yaml"))


@pytest.mark.parametrize("path", ["[/bold].yaml", "a[red]b.yaml", "x[/]y/[bold]r.yaml"])
def test_markup_in_a_path_is_shown_as_written(gemctl, path):
    result = gemctl("validate", path)
    clean_exit(result, 2)
    assert f"{path} does not exist" in result.stderr


@pytest.mark.parametrize("override, needle", [
    ("x[/]=1", "x[/]: unknown field"),
    ("model.attention=[/bold]", "model.attention"),
    ('tracking.run_name="[red]x[/]"', None),
])
def test_markup_in_an_override(gemctl, override, needle):
    result = gemctl("validate", str(REPO / "recipes/demo.yaml"), "--set", override)
    if needle is None:
        clean_exit(result, 0)
        return
    clean_exit(result, 2)
    assert needle in result.stderr


def test_runs_lists_a_run_whose_name_is_markup(gemctl, sqlite_uri):
    client = MlflowClient(sqlite_uri)
    exp = client.create_experiment("evil[/bold]")
    run = client.create_run(exp, run_name="evil[/bold] [red]x")
    client.set_terminated(run.info.run_id)
    result = gemctl("runs", "--tracking-uri", sqlite_uri)
    clean_exit(result)
    assert "evil[/bold] [red]x" in result.output and "evil[/bold]" in result.output


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates_and_plans(gemctl, recipe, tmp_path, monkeypatch):
    """movielens and multinode read data that is not on this machine: the plan falls back
    to the recipe's own sizes and says so."""
    monkeypatch.chdir(tmp_path)
    clean_exit(gemctl("validate", str(recipe)))
    result = gemctl("plan", str(recipe))
    clean_exit(result)
    assert "process groups" in result.output and "data sizes from" in result.output


def test_readme_multinode_plan_with_meta_file(gemctl, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clean_exit(gemctl("data", "generate", str(REPO / "recipes/demo.yaml"),
                      "--set", "data.synthetic.num_samples=200",
                      "--set", f"data.path={tmp_path / 'd'}"))
    result = gemctl("plan", str(REPO / "recipes/multinode.yaml"), "--meta",
                    str(tmp_path / "d" / "meta.json"))
    clean_exit(result)
    assert "meta.json" in result.output.replace("\n", "")
    missing = gemctl("plan", str(REPO / "recipes/multinode.yaml"), "--meta",
                     str(tmp_path / "nope"))
    clean_exit(missing, 2)
    assert "--meta" in missing.stderr


@pytest.mark.parametrize("spec", SWEEPS, ids=lambda p: p.name)
def test_validate_accepts_sweep_specs(gemctl, spec):
    result = gemctl("validate", str(spec))
    clean_exit(result)
    assert "sweep" in result.output and "is valid" in result.output


def test_directory_as_recipe(gemctl, tmp_path):
    for command in ("validate", "submit", "plan", "profile-data"):
        result = gemctl(command, str(tmp_path))
        clean_exit(result, 2)
        assert "is a directory" in result.stderr and "does not exist" not in result.stderr


@pytest.mark.parametrize("option", ["--world", "--gpus-per-host", "--hosts-per-zone"])
def test_plan_names_the_option_not_the_field(gemctl, option):
    result = gemctl("plan", str(REPO / "recipes/demo.yaml"), option, "0")
    assert result.exit_code == 2
    assert option in result.output + result.stderr
    assert "parallel." not in result.output + result.stderr


def test_fix_hint_points_to_a_real_command(gemctl):
    bad = gemctl("validate", str(REPO / "recipes/demo.yaml"), "--set", "train.stepz=3")
    clean_exit(bad, 2)
    assert "gemctl validate --schema" in bad.stderr
    schema = gemctl("validate", "--schema")
    clean_exit(schema)
    assert "train.steps" in schema.output and "training steps" in schema.output


def test_yaml_bomb_is_refused_quickly(gemctl, tmp_path):
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nmodel: {attention: *l8}\n")
    start = time.perf_counter()
    result = gemctl("validate", str(path))
    assert time.perf_counter() - start < 10
    clean_exit(result, 2)
    assert "aliases expand" in result.stderr and len(result.stderr) < 600


@pytest.mark.parametrize("override", ["train.lr=1e308", "train.lr=.inf", "train.steps=true",
                                      "train.steps=1e23"])
def test_numbers_that_cannot_train(gemctl, override):
    result = gemctl("validate", str(REPO / "recipes/demo.yaml"), "--set", override)
    clean_exit(result, 2)
    assert override.split("=")[0] in result.stderr


@pytest.mark.parametrize("content, needle", [("", "is empty"),
                                             ("name: a\nname: b\n", "appears twice")])
def test_empty_and_duplicate(gemctl, tmp_path, content, needle):
    path = Path(tmp_path / "r.yaml")
    path.write_text(content)
    result = gemctl("validate", str(path))
    clean_exit(result, 2)
    assert needle in result.stderr


def test_submit_tracking_uri_option_and_its_password(gemctl, tmp_path, monkeypatch):
    """--tracking-uri reaches the run; an unreachable server is named, its password masked."""
    from tests.conftest import free_port
    from tests.sweep.test_spec import BASE

    monkeypatch.chdir(tmp_path)
    (tmp_path / "base.yaml").write_text(
        BASE + "loader: {local_batch_size: 64, base_batch_size: 16}\n")
    uri = f"http://bob:pa55word@127.0.0.1:{free_port()}"
    result = gemctl("submit", "base.yaml", "--local", "--tracking-uri", uri)
    clean_exit(result, 2)
    assert "unreachable" in result.stderr and "bob:***@127.0.0.1" in result.stderr
    assert "pa55word" not in result.output + result.stderr


def test_sweep_specs_are_read_as_strictly_as_recipes(gemctl, tmp_path):
    (tmp_path / "base.yaml").write_text("name: b\ntrain: {steps: 2}\ntrain: {steps: 3}\n")
    (tmp_path / "s.yaml").write_text("name: s\nbase: base.yaml\narms: {a: []}\n")
    result = gemctl("validate", str(tmp_path / "s.yaml"))
    clean_exit(result, 2)
    assert "Base recipe" in result.stderr and "'train' appears twice" in result.stderr
    (tmp_path / "s2.yaml").write_text("name: s\nname: t\nbase: base.yaml\narms: {a: []}\n")
    result = gemctl("sweep", str(tmp_path / "s2.yaml"), "--in-process")
    clean_exit(result, 2)
    assert "'name' appears twice" in result.stderr
