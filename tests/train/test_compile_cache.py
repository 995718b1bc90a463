"""A deterministic run compiles into its recipe's own Inductor cache, so graphs another recipe
compiled at other sizes can't change its bits."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gem_platform.recipe import recipe_from_dict
from gem_platform.train import compile_cache
from gem_platform.train.compile_cache import CACHE_ENV, cache_name, own_compile_cache
from tests.tiny_training import tiny_tree, train_losses


@pytest.fixture
def default_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Inductor's default cache folder, here under tmp_path; the variable unset."""
    folder = tmp_path / "torchinductor_user"
    monkeypatch.setattr(compile_cache, "_inductor_default", lambda: str(folder))
    monkeypatch.delenv(CACHE_ENV, raising=False)
    return folder


def _recipe(tmp_path: Path, **train):
    return recipe_from_dict(tiny_tree(tmp_path / "data", **train))


def test_the_name_ignores_the_seed_and_tracking_but_not_the_data_model_or_rank(tmp_path):
    base = _recipe(tmp_path, seed=0)
    assert cache_name(_recipe(tmp_path, seed=7), 0) == cache_name(base, 0)
    tracked = tiny_tree(tmp_path / "data", seed=0)
    tracked["tracking"]["experiment"] = "elsewhere"
    assert cache_name(recipe_from_dict(tracked), 0) == cache_name(base, 0)
    shorter = tiny_tree(tmp_path / "data", seed=0)
    shorter["data"]["synthetic"]["seq_len"]["mean"] = 6  # another world's sizes
    assert cache_name(recipe_from_dict(shorter), 0) != cache_name(base, 0)
    wider = tiny_tree(tmp_path / "data", seed=0)
    wider["model"]["d_model"] = 32
    assert cache_name(recipe_from_dict(wider), 0) != cache_name(base, 0)
    assert cache_name(base, 1) != cache_name(base, 0)
    assert cache_name(base, 1).endswith("-rank1")


def test_a_deterministic_compiling_run_gets_the_folder_and_the_variable_comes_back(
        tmp_path, default_dir):
    recipe = _recipe(tmp_path, deterministic=True)
    with own_compile_cache(recipe, 0, compiles=True) as path:
        assert path == str(default_dir / cache_name(recipe, 0)) == os.environ[CACHE_ENV]
    assert CACHE_ENV not in os.environ
    os.environ[CACHE_ENV] = str(default_dir)  # Inductor writes its default there at first use
    with own_compile_cache(recipe, 0, compiles=True) as path:
        assert path == os.environ[CACHE_ENV] != str(default_dir)
    assert os.environ[CACHE_ENV] == str(default_dir)


@pytest.mark.parametrize("deterministic, compiles", [(False, True), (True, False)])
def test_nothing_changes_for_a_run_that_is_not_deterministic_or_compiles_nothing(
        tmp_path, default_dir, deterministic, compiles):
    with own_compile_cache(_recipe(tmp_path, deterministic=deterministic), 0, compiles) as path:
        assert path is None and CACHE_ENV not in os.environ


def test_a_folder_the_user_chose_is_kept(tmp_path, default_dir, monkeypatch):
    chosen = str(tmp_path / "mine")
    monkeypatch.setenv(CACHE_ENV, chosen)
    with own_compile_cache(_recipe(tmp_path, deterministic=True), 0, compiles=True) as path:
        assert path is None and os.environ[CACHE_ENV] == chosen


NO_COMPILER = not (shutil.which("c++") or shutil.which("g++"))


@pytest.mark.skipif(NO_COMPILER, reason="Inductor on CPU needs a C++ compiler")
def test_a_compiled_deterministic_run_writes_its_graphs_into_its_own_folder(
        tmp_path, default_dir):
    """Real training, compiled by Inductor on CPU: its graphs land in the recipe's folder, the
    run says where, and the variable is back to unset after it."""
    tree = tiny_tree(tmp_path / "data", seq_layers=1, deterministic=True, compile=True,
                     compile_backend="inductor", steps=2)
    lines: list[str] = []
    losses, _ = train_losses(tree, echo=lambda e: lines.append(str(e)))
    own = default_dir / cache_name(recipe_from_dict(tree), 0)
    assert len(losses) == 2
    assert any(str(own) in line for line in lines)
    assert any(p.is_file() for p in own.rglob("*")), "nothing compiled into the recipe's folder"
    assert not (default_dir / "fxgraph").exists()  # nothing went to the shared folder
    assert CACHE_ENV not in os.environ
