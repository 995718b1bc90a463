"""Fuzzing recipe loading and --set overrides: any input gives a valid recipe or a RecipeError
(never another exception), and nothing the user's environment holds ends up in run params."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gem_platform.errors import RecipeError
from gem_platform.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo.yaml"

FIELDS = ["model.attention", "model.d_model", "model.num_heads", "train.steps", "train.lr",
          "loader.local_batch_size", "loader.batching", "parallel.workers",
          "parallel.hsdp_shard_group", "precision.mode", "precision.block", "data.path",
          "data.synthetic.seq_len.min", "tracking.tags", "nope", "model", "train.steps.x", ""]
VALUES = st.one_of(st.integers(-5, 10_000), st.floats(allow_nan=True), st.booleans(),
                   st.text(max_size=12), st.sampled_from(["full", "block64", "[1, 2", "{a: 1}",
                                                          "null", "~", "- x", "fp8_block"]))
yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                         st.text(max_size=8))
yaml_trees = st.recursive(yaml_scalars, lambda children: st.one_of(
    st.lists(children, max_size=3),
    st.dictionaries(st.sampled_from(["model", "train", "data", "loader", "parallel",
                                     "precision", "tracking", "steps", "attention", "x"]),
                    children, max_size=4)), max_leaves=12)

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _load_or_recipe_error(path: Path, overrides: list[str]) -> None:
    try:
        load_recipe(path, overrides)
    except RecipeError as err:
        assert err.problem and err.fix


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(FIELDS), VALUES), max_size=4))
def test_overrides_never_escape_as_other_errors(pairs):
    _load_or_recipe_error(DEMO, [f"{k}={v}" for k, v in pairs])


@SETTINGS
@given(st.text(max_size=40))
def test_raw_override_text(text):
    _load_or_recipe_error(DEMO, [text])


@SETTINGS
@given(yaml_trees)
def test_arbitrary_yaml_documents(tmp_path_factory, tree):
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(yaml.safe_dump(tree))
    _load_or_recipe_error(path, [])


@SETTINGS
@given(st.binary(max_size=64))
def test_arbitrary_bytes(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_bytes(blob)
    _load_or_recipe_error(path, [])


def test_params_hold_the_recipe_only(monkeypatch):
    """Run params are the flattened recipe: no environment variable or secret leaks in."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2")
    flat = load_recipe(DEMO).flat()
    sections = {"name", "model", "data", "loader", "train", "parallel", "precision", "tracking"}
    assert {k.split(".")[0] for k in flat} <= sections
    assert not any("s3cr3t" in str(v) or "hunter2" in str(v) for v in flat.values())
