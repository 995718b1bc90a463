"""Recipe validation: every error names the field path and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from gem_platform.errors import RecipeError
from gem_platform.recipe import load_recipe, parse_override

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*.yaml")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_recipes_are_valid(recipe):
    load_recipe(recipe)


def test_overrides_are_typed():
    r = load_recipe(REPO / "recipes/demo.yaml",
                    ["train.steps=50", "model.attention=block64", "train.lr=1e-3",
                     "parallel.use_gpu=false"])
    assert r.train.steps == 50 and isinstance(r.train.steps, int)
    assert r.model.attention == "block64"
    assert r.train.lr == pytest.approx(1e-3)
    assert r.parallel.use_gpu is False


@pytest.mark.parametrize("text, needle", [
    ("model:\n  atention: full\n", "model.atention: unknown field"),
    ("train:\n  steps: many\n", "train.steps"),
    ("model:\n  attention: sparse\n", "model.attention"),
    ("model:\n  d_model: 30\n  num_heads: 4\n", "model.d_model=30 must be divisible"),
    ("model:\n  rope: true\n  d_model: 18\n  num_heads: 2\n", "model.rope needs an even head dim"),
    ("precision:\n  mode: fp8_block\nmodel:\n  d_model: 48\n  num_heads: 2\n",
     "precision.mode=fp8_block needs model.d_model divisible by 32"),
    ("- a\n- b\n", "must be a YAML mapping"),
    ("bogus_section: {}\n", "bogus_section: unknown field"),
])
def test_invalid_recipes_name_the_field(tmp_path, text, needle):
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, text))
    assert needle in str(err.value)
    assert err.value.fix


def test_literal_errors_list_allowed_values(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, "model:\n  attention: sparse\n"))
    for allowed in ("full", "sliding", "block64", "padded"):
        assert allowed in str(err.value)


def test_malformed_yaml_gives_line(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, "model:\n  d_model: 32\n   num_heads: [2\n"))
    assert "not valid YAML at line" in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize("bad", ["train.steps", "=3", "train..steps=3"])
def test_bad_override_syntax(bad):
    with pytest.raises(RecipeError):
        parse_override(bad)


def test_override_unknown_field_is_rejected():
    with pytest.raises(RecipeError, match="train.stepz: unknown field"):
        load_recipe(REPO / "recipes/demo.yaml", ["train.stepz=5"])


def test_override_into_value_is_rejected():
    with pytest.raises(RecipeError, match="is a value, not a section"):
        load_recipe(REPO / "recipes/demo.yaml", ["train.steps.x=5"])


def test_yaml_loading_is_safe(tmp_path):
    """Python object tags are refused, not executed."""
    p = write(tmp_path, "name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(p)


def test_flat_params_cover_every_section():
    flat = load_recipe(REPO / "recipes/demo.yaml").flat()
    for key in ("model.attention", "data.path", "loader.batching", "train.steps",
                "parallel.workers", "precision.mode", "tracking.experiment"):
        assert key in flat
