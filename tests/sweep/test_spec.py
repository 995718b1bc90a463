"""Sweep specs: the shipped ablations resolve into valid per-arm recipes; every malformed spec
fails before anything runs, naming the field (or the arm) and exiting 2 without a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from gem_platform.recipe import TrainConfig
from gem_platform.sweep.config import SweepError, load_sweep
from tests.conftest import REPO, gemctl_in_process

BASE = """
name: tiny
model: {d_model: 32, num_heads: 2, pooled_queries: 2, dhen_layers: 1, expert_hidden: 32,
        head_hidden: 32}
data: {source: synthetic, path: data, synthetic: {num_samples: 600, num_users: 50,
       num_items: 50}}
train: {steps: 2}
parallel: {workers: 1}
tracking: {experiment: spec-test}
"""


@pytest.fixture
def spec_dir(tmp_path: Path) -> Path:
    (tmp_path / "base.yaml").write_text(BASE)
    return tmp_path


def write(spec_dir: Path, text: str) -> Path:
    path = spec_dir / "sweep.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name, arms, baseline, seeds", [
    ("attention", ["padded", "full", "sliding", "block64"], "padded", [0, 1]),
    ("precision", ["bf16", "fp32", "fp8_block"], "bf16", [0, 1, 2, 3]),
    ("loader", ["no_balancing", "bbs"], "no_balancing", [0, 1]),
    ("precision_h200", ["bf16", "fp32", "fp8_b128", "fp8_b32"], "bf16", [0, 1, 2, 3, 4, 5]),
    ("attention_h200", ["full", "sliding", "block64", "full_no_rope", "block64_no_rope"], "full",
     [0, 1, 2, 3, 4, 5]),
    ("recall_controls", ["full", "block64", "full_token_keys", "full_rope", "full_local",
                         "block64_local"], "full", [0, 1, 2]),
    ("recall_h200", ["full", "sliding", "block64", "full_token_keys", "full_no_rope",
                     "block64_no_rope", "full_newest", "block64_newest", "full_rope_newest",
                     "block64_rope_newest", "sliding_newest"],
     "full_newest", [0, 1, 2, 3]),
])
def test_shipped_ablations_resolve(name, arms, baseline, seeds, monkeypatch):
    monkeypatch.chdir(REPO)
    plan = load_sweep(REPO / "recipes" / "ablations" / f"{name}.yaml")
    assert [a.name for a in plan.arms] == arms
    assert plan.baseline == baseline and plan.seeds == seeds
    recipes = {a.name: a.recipe for a in plan.arms}
    if name == "attention":
        assert {r.model.attention for r in recipes.values()} == {"padded", "full", "sliding",
                                                                 "block64"}
    if name == "precision":
        assert {n: r.precision.mode for n, r in recipes.items()} == {
            "bf16": "bf16", "fp32": "fp32", "fp8_block": "fp8_block"}
    if name == "precision_h200":
        assert {n: (r.precision.mode, r.precision.block) for n, r in recipes.items()
                if r.precision.mode == "fp8_block"} == {"fp8_b128": ("fp8_block", 128),
                                                       "fp8_b32": ("fp8_block", 32)}
        assert {r.train.device for r in recipes.values()} == {"cuda"}
    if name == "attention_h200":
        assert {n: (r.model.attention, r.model.rope) for n, r in recipes.items()} == {
            "full": ("full", True), "sliding": ("sliding", True), "block64": ("block64", True),
            "full_no_rope": ("full", False), "block64_no_rope": ("block64", False)}
    if name.startswith("recall"):  # the positive control: category keys, one projection
        keys = {n: (r.model.attention, r.model.attention_qk, r.model.shared_qk)
                for n, r in recipes.items()}
        assert keys["full"] == ("full", "category", True)
        assert keys["block64"] == ("block64", "category", True)
        assert {r.data.synthetic.world for n, r in recipes.items()
                if not n.endswith("_local")} == {"recall"}
    if name == "recall_h200":  # RoPE as h200 ships it, but in the arms that leave it out
        assert {n for n, r in recipes.items() if not r.model.rope} == {
            "full_no_rope", "block64_no_rope", "full_newest", "block64_newest",
            "sliding_newest"}
        assert keys["full_no_rope"] == ("full", "category", True)
        # the newest event's token joins DHEN only in the arms that test it
        assert {n for n, r in recipes.items() if r.model.newest_token} == {
            "full_newest", "block64_newest", "sliding_newest", "full_rope_newest",
            "block64_rope_newest"}
    if name == "loader":
        assert recipes["no_balancing"].loader.batching == "sequential"
    # Arms differ only where their overrides say; seeds vary the model, never the data
    # (a controls spec pairs two worlds: one dataset per world).
    data = {r.data.model_dump_json() for r in recipes.values()}
    assert len(data) == (2 if name == "recall_controls" else 1)
    assert Path(plan.arms[0].recipe.data.path).is_absolute()
    assert plan.trial_recipe(arms[0], 1).train.seed == 1


SHIPPED_SPECS = sorted([*(REPO / "recipes" / "ablations").glob("*.yaml"),
                        *(REPO / "deploy" / "sweeps").glob("*.yaml")])


@pytest.mark.parametrize("spec", SHIPPED_SPECS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_specs_train_within_one_epoch(spec, monkeypatch):
    """Past one pass over its training split a recommendation model memorizes its per-id
    rows, and a gate then compares memorized arms: no shipped ablation goes there (the deploy
    sweeps at 8 ranks once trained 6.8 epochs of recipes/h200.yaml's data)."""
    monkeypatch.chdir(REPO)
    plan = load_sweep(spec)
    assert plan.past_one_epoch() == {}
    assert all(0 < (a.recipe.planned_epochs() or 0) <= 1 for a in plan.arms)


def test_a_sweep_past_one_epoch_is_named_before_any_trial(spec_dir, monkeypatch):
    """train.steps x local batch x ranks over the generated training split: an arm of 40
    steps of 16 samples on each of 2 workers passes 2.4 times over 540 training samples (1.2
    times in one process, as an --in-process trial trains); `gemctl sweep` prints the line
    before its first trial, with the figure of the mode it runs in."""
    from gemctl.render import epochs_warning

    text = """
name: long
base: base.yaml
set: [parallel.workers=2, loader.local_batch_size=16, loader.batching=sequential]
arms:
  short: [train.steps=15]
  long: [train.steps=40]
"""
    plan = load_sweep(write(spec_dir, text))
    assert plan.arms[0].recipe.planned_epochs() == pytest.approx(15 * 32 / 540)
    assert plan.past_one_epoch() == {"long": pytest.approx(40 * 32 / 540)}
    line = epochs_warning(plan, in_process=False)
    assert line.startswith("warning:") and "long 2.4" in line and "short" not in line
    assert "parallel.workers" in line and "data.synthetic.num_samples" in line
    assert "long 1.2" in epochs_warning(plan, in_process=True)
    assert epochs_warning(load_sweep(write(spec_dir, text.replace("steps=40", "steps=16"))),
                           in_process=False) is None
    from gem_platform.recipe import Recipe
    parquet = Recipe.model_validate({"data": {"source": "parquet", "path": "x"}})
    assert parquet.planned_epochs() is None  # its size is known once it is read


def test_grid_expands_to_product(spec_dir):
    plan = load_sweep(write(spec_dir, """
name: g
base: base.yaml
seeds: [3]
grid: {model.attention: [padded, full], precision.mode: [fp32, bf16]}
"""))
    assert [a.name for a in plan.arms] == ["attention=padded,mode=fp32",
                                           "attention=padded,mode=bf16",
                                           "attention=full,mode=fp32",
                                           "attention=full,mode=bf16"]
    assert plan.arms[3].recipe.precision.mode == "bf16"
    assert plan.baseline == "attention=padded,mode=fp32"
    assert plan.trials()[0] == ("attention=padded,mode=fp32", 3)


def test_fingerprint_tracks_what_changes_results(spec_dir):
    text = "name: f\nbase: base.yaml\nseeds: [0, 1]\narms: {a: [train.lr=0.01], b: []}\n"
    one = load_sweep(write(spec_dir, text)).fingerprint()
    assert load_sweep(write(spec_dir, text)).fingerprint() == one
    assert load_sweep(write(spec_dir, text.replace("[0, 1]", "[0, 2]"))).fingerprint() != one
    assert load_sweep(write(spec_dir, text), ["train.steps=3"]).fingerprint() != one
    # a setting at its default is not part of it: recipes that gain a setting (with a default
    # that keeps what they did) keep their sweeps resumable
    default = f"train.perf_warmup_steps={TrainConfig().perf_warmup_steps}"
    assert load_sweep(write(spec_dir, text), [default]).fingerprint() == one
    assert load_sweep(write(spec_dir, text), ["train.perf_warmup_steps=3"]).fingerprint() != one


def test_sweeps_train_deterministically_unless_the_spec_says_not(spec_dir):
    text = "name: d\nbase: base.yaml\narms: {a: [], b: [train.deterministic=false]}\n"
    plan = load_sweep(write(spec_dir, text))
    assert [a.recipe.train.deterministic for a in plan.arms] == [True, False]
    assert TrainConfig().deterministic is False  # a plain run keeps the recipe's choice
    off = load_sweep(write(spec_dir, "deterministic: false\n" + text))
    assert [a.recipe.train.deterministic for a in off.arms] == [False, False]
    on = load_sweep(write(spec_dir, text), ["train.deterministic=true"])  # --set beats spec
    assert on.arms[0].recipe.train.deterministic
    assert off.fingerprint() != plan.fingerprint()  # determinism decides results
    assert plan.fingerprint_record()["deterministic"] == {"a": True, "b": False}


def test_spec_gates(spec_dir):
    text = "name: g\nbase: base.yaml\narms: {a: []}\n"
    assert load_sweep(write(spec_dir, text)).gates.max_ne_regression_pct == 0.1
    plan = load_sweep(write(spec_dir, text + "gates: {max_ne_regression: 0.5%, "
                                              "max_auc_drop: 0.002}\n"))
    assert (plan.gates.max_ne_regression_pct, plan.gates.max_auc_drop) == (0.5, 0.002)
    with pytest.raises(SweepError, match="gates.max_ne_regression"):
        load_sweep(write(spec_dir, text + "gates: {max_ne_regression: lots}\n"))


@pytest.mark.parametrize("text, needle", [
    ("name: x\nbase: base.yaml\narms: {a: []}\nsedes: [1]\n", "sedes: unknown field"),
    ("name: x\nbase: base.yaml\n", "exactly one of 'arms'"),
    ("name: x\nbase: base.yaml\narms: {a: []}\ngrid: {train.lr: [1]}\n", "exactly one of"),
    ("name: x\nbase: base.yaml\narms: {a: []}\nbaseline: b\n", "baseline 'b' is not an arm"),
    ("name: x\nbase: base.yaml\nseeds: [1, 1]\narms: {a: []}\n", "seeds: seeds [1, 1] repeat"),
    ("name: x\nbase: base.yaml\nseeds: []\narms: {a: []}\n", "seeds:"),
    ("name: x\nbase: base.yaml\nmax_concurrent: 0\narms: {a: []}\n", "max_concurrent:"),
    ("name: x y\nbase: base.yaml\narms: {a: []}\n", "name:"),
    ("name: x\nbase: nope.yaml\narms: {a: []}\n", "base recipe nope.yaml"),
    ("name: x\nbase: base.yaml\narms: {a: [], b: [model.attention=sparse]}\n",
     "arm 'b': Recipe base.yaml + arm 'b' is invalid: model.attention"),
    ("name: x\nbase: base.yaml\narms: {a: [train.steps]}\n", "arm 'a': Override"),
    ("name: x\nbase: base.yaml\narms: {a: []\n", "not valid YAML"),
    ("- a\n- b\n", "must be a YAML mapping"),
])
def test_bad_specs_name_the_field(spec_dir, text, needle):
    with pytest.raises(SweepError) as info:
        load_sweep(write(spec_dir, text))
    assert needle in info.value.problem, info.value.problem
    assert info.value.fix


def test_cli_bad_spec_exits_2_without_traceback(spec_dir):
    write(spec_dir, "name: x\nbase: base.yaml\narms: {a: []}\nbaseline: b\n")
    proc = gemctl_in_process("sweep", "sweep.yaml", cwd=spec_dir)
    assert proc.returncode == 2, proc.stderr
    assert "baseline 'b' is not an arm" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (spec_dir / "mlflow.db").exists()
    proc = gemctl_in_process("sweep", "missing.yaml", cwd=spec_dir)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_spec_errors_are_worded_like_recipe_errors(spec_dir):
    """A sweep spec's problems are described as a recipe's are: long keys cut short, at most
    ten problems named and the rest counted."""
    from gem_platform.errors import RecipeError
    from gem_platform.recipe import load_recipe

    keys = "".join(f"{'k' * 300}{i}: 1\n" for i in range(12))
    with pytest.raises(SweepError) as spec_info:
        load_sweep(write(spec_dir, "name: x\nbase: base.yaml\narms: {a: []}\n" + keys))
    recipe = spec_dir / "keys.yaml"
    recipe.write_text(keys)
    with pytest.raises(RecipeError) as recipe_info:
        load_recipe(recipe)
    for problem in (spec_info.value.problem, recipe_info.value.problem):
        assert problem.endswith("and 2 more."), problem
        assert "k" * 300 not in problem and "k" * 117 + "...: unknown field" in problem
    assert "unknown field (allowed: name, base, seeds" in spec_info.value.problem
