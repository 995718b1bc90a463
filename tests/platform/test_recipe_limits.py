"""Recipe inputs that used to slip through or hang: numbers no run can use, booleans taken as
integers, duplicate keys, empty files, directories, YAML alias bombs and huge echoed values.
Each must be a RecipeError naming the field or file, quickly."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gem_platform.errors import RecipeError
from gem_platform.recipe import field_rows, load_recipe, recipe_json_schema

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo.yaml"


def error_of(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as err:
        load_recipe(path, overrides or [])
    assert err.value.fix
    return err.value.problem


@pytest.mark.parametrize("override, needle", [
    ("train.lr=1e308", "train.lr"),
    ("train.lr=.inf", "train.lr: must be a finite number"),
    ("train.lr=.nan", "train.lr: must be a finite number"),
    ("train.sparse_lr=-.inf", "train.sparse_lr"),
    ("train.steps=true", "train.steps: expected an integer, got the boolean true"),
    ("train.steps=1.0e+23", "train.steps"),
    ("train.steps=1e23", "train.steps"),
    ("model.d_model=false", "model.d_model: expected an integer"),
    ("train.grad_clip=true", "train.grad_clip: expected a number"),
    ("train.seed=-1", "train.seed"),
    ("data.synthetic.num_samples=true", "data.synthetic.num_samples: expected an integer"),
    ("data.synthetic.seq_len.mean=.inf", "data.synthetic.seq_len.mean: must be a finite"),
    ("data.synthetic.sparse_features=[{name: a, vocab_size: true}]",
     "data.synthetic.sparse_features.0.vocab_size: expected an integer"),
    ("parallel.workers=100000000000000000000", "parallel.workers"),
])
def test_numbers_that_cannot_train_are_refused(override, needle):
    assert needle in error_of(DEMO, [override])


def test_duplicate_keys_are_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("name: dup\ntrain:\n  steps: 3\n  lr: 0.1\n  steps: 4\n")
    problem = error_of(path)
    assert "'steps' appears twice (lines 3 and 5)" in problem and "dup.yaml" in problem


def test_duplicate_sections_are_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("name: dup\ntrain: {steps: 3}\nmodel: {d_model: 32}\ntrain: {lr: 0.1}\n")
    assert "'train' appears twice" in error_of(path)


def test_merge_keys_still_work(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {steps: 3, lr: 0.01}\nname: m\ntrain:\n  <<: *b\n  steps: 5\n"
                    .replace("base: &b", "x-base: &b"))
    # x-base is not a recipe field: the merge itself is accepted, the stray key is named.
    assert "x-base: unknown field" in error_of(path)


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / "empty.yaml"
    path.write_text(content)
    assert "is empty" in error_of(path)


def test_directory_is_not_reported_missing(tmp_path):
    problem = error_of(tmp_path)
    assert "is a directory" in problem and "does not exist" not in problem


def test_yaml_alias_bomb_is_bounded(tmp_path):
    """Nine levels of nine aliases (387M values once expanded) in a Literal field."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nmodel: {attention: *l8}\n")
    start = time.perf_counter()
    problem = error_of(path)
    assert time.perf_counter() - start < 5
    assert "aliases expand to more than" in problem
    assert len(problem) < 500


def test_moderate_alias_use_is_fine(tmp_path):
    path = tmp_path / "alias.yaml"
    path.write_text("name: a\nmodel: {d_model: &w 32, expert_hidden: *w, head_hidden: *w}\n")
    recipe = load_recipe(path)
    assert recipe.model.expert_hidden == 32


def test_echoed_input_is_bounded(tmp_path):
    big = "y" * 100_000
    problem = error_of(DEMO, [f"model.attention={big}"])
    assert "model.attention" in problem and len(problem) < 1000
    path = tmp_path / "long.yaml"
    path.write_text(f"name: long\nmodel: {{attention: [{', '.join(['abc'] * 20000)}]}}\n")
    assert len(error_of(path)) < 1000


def test_recursive_alias_is_refused(tmp_path):
    path = tmp_path / "rec.yaml"
    path.write_text("model: &m {attention: *m}\n")
    assert "alias" in error_of(path) or "not valid YAML" in error_of(path)


def test_oversized_file_is_refused(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("name: huge\n" + "# padding\n" * 200_000)
    assert "bytes" in error_of(path)


def test_schema_lists_every_field_with_descriptions():
    rows = {path: (kind, default, desc) for path, kind, default, desc in field_rows()}
    assert rows["train.lr"][0] == "float (> 0, <= 10)"
    assert rows["model.attention"][0] == "full | sliding | block64 | padded"
    assert rows["train.steps"][1] == "200"
    assert all(rows[k][2] for k in rows if k.split(".")[0] in ("model", "train", "tracking"))
    schema = recipe_json_schema()
    assert set(schema["properties"]) >= {"model", "train", "data", "parallel", "tracking"}
