"""The recipe fields of the evaluation schedule: the default schedule, 0 = final evaluation
only, and bad values refused with the field and what is allowed."""

from __future__ import annotations

import pytest

from gem_platform.errors import RecipeError
from gem_platform.recipe import apply_overrides, recipe_from_dict


def _train(*overrides: str):
    return recipe_from_dict(apply_overrides({}, list(overrides))).train


def test_default_schedule_is_about_ten_evaluations_per_run():
    assert _train("train.steps=600", "train.log_every=10").eval_interval() == 60
    assert _train("train.steps=30", "train.log_every=10").eval_interval() == 10  # not below
    assert _train("train.steps=600", "train.eval_every=200").eval_interval() == 200
    assert _train("train.steps=600", "train.eval_every=0").eval_interval() == 0
    assert _train("train.eval_every=null").eval_every is None
    default = _train()
    assert default.eval_sample == 2048 and default.target_ne is None


@pytest.mark.parametrize(("override", "needle"), [
    ("train.eval_sample=0", "train.eval_sample"),
    ("train.eval_every=-1", "train.eval_every"),
    ("train.target_ne=0", "train.target_ne"),
    ("train.target_ne=abc", "train.target_ne"),
])
def test_bad_values_name_the_field(override, needle):
    with pytest.raises(RecipeError) as err:
        _train(override)
    assert needle in str(err.value)
