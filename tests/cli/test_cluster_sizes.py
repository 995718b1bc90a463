"""Sizes no cluster has are refused at once, with the limit and why: `gemctl plan --world
1000000000` and `gemctl profile-data --world 100000000` answer at once instead of computing
for minutes, and so do the recipe's own parallel sizes.

"At once" is a bound far from both sides: the unbounded versions ran for minutes, while a
refusal takes well under a second on a quiet machine and 1.3 s was seen on a loaded 2-core
CI machine, so a tight wall-clock bound failed on load alone."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gem_platform.balance.config import LoaderConfig
from gem_platform.balance.profile import profile_lengths
from gem_platform.errors import RecipeError
from gem_platform.topology.config import MAX_WORLD, ParallelConfig, divisors
from tests.cli.conftest import REPO, clean_exit

DEMO = str(REPO / "recipes" / "demo.yaml")
AT_ONCE_S = 10.0  # a command's refusal; the defect took minutes
AT_ONCE_CALL_S = 2.0  # one library call's refusal; the defect took minutes


def timed(gemctl, *args: str):
    start = time.perf_counter()
    result = gemctl(*args)
    return result, time.perf_counter() - start


@pytest.mark.parametrize("args, flag", [
    (("plan", DEMO, "--world", "1000000000"), "--world"),
    (("plan", DEMO, "--gpus-per-host", "99999999999"), "--gpus-per-host"),
    (("plan", DEMO, "--world", "64", "--hosts-per-zone", "10000000"), "--hosts-per-zone"),
    (("profile-data", DEMO, "--world", "100000000"), "--world"),
])
def test_impossible_cluster_options(gemctl, args, flag):
    result, seconds = timed(gemctl, *args)
    clean_exit(result, 2)
    assert seconds < AT_ONCE_S, seconds
    text = " ".join(result.stderr.split())
    assert flag in text and f"{MAX_WORLD:,}" in text and "largest cluster" in text


@pytest.mark.parametrize("override", ["parallel.workers=1000000000",
                                      "parallel.hsdp_shard_group=999999999",
                                      "parallel.cpus_per_worker=100000000"])
def test_impossible_recipe_sizes(gemctl, override):
    result, seconds = timed(gemctl, "validate", DEMO, "--set", override)
    clean_exit(result, 2)
    assert seconds < AT_ONCE_S, seconds
    assert override.split("=")[0] in result.stderr and "less than or equal" in result.stderr


def test_a_size_that_does_not_divide_a_huge_world_is_named_at_once():
    start = time.perf_counter()
    with pytest.raises(RecipeError, match="does not divide"):
        ParallelConfig(workers=MAX_WORLD - 1, hsdp_shard_group=2).validate_against_world()
    assert time.perf_counter() - start < AT_ONCE_CALL_S
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert divisors(1) == [1] and divisors(13) == [1, 13]


def test_more_ranks_than_samples_is_refused_before_dealing():
    start = time.perf_counter()
    with pytest.raises(RecipeError, match="100,000,000 ranks"):
        profile_lengths(np.ones(5000), world=100_000_000, local_batch=8, cfg=LoaderConfig())
    assert time.perf_counter() - start < AT_ONCE_CALL_S


@pytest.mark.parametrize("options", [("--world", "131072"), ("--local-batch", "1000000000")])
def test_profile_data_refuses_a_step_larger_than_the_dataset_before_making_it(
        gemctl, tmp_path, options):
    """A step that needs more samples than the recipe's synthetic dataset holds is refused
    from the recipe alone: nothing is generated or read first."""
    out = tmp_path / "ds"
    result, seconds = timed(gemctl, "profile-data", DEMO, *options, "--set",
                            f"data.path={out}", "--out", str(tmp_path / "profile"))
    clean_exit(result, 2)
    assert "training samples can't give" in " ".join(result.stderr.split())
    assert seconds < AT_ONCE_S, seconds
    assert sorted(tmp_path.iterdir()) == []
