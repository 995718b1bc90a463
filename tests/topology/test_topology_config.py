"""The recipe's parallel section: validation names the field and the valid choices."""

from __future__ import annotations

import pydantic
import pytest

from gem_platform.errors import RecipeError
from gem_platform.topology import ParallelConfig


def test_defaults_are_two_cpu_workers_with_gloo() -> None:
    p = ParallelConfig()
    assert p.workers == 2 and p.ranks_per_host() == 1
    assert p.resolved_backend() == "gloo"
    assert ParallelConfig(use_gpu=True).resolved_backend() == "nccl"
    assert ParallelConfig(use_gpu=True).ranks_per_host() is None  # discovered
    assert ParallelConfig(use_gpu=True, backend="gloo").resolved_backend() == "gloo"
    p.validate_against_world()


def test_unknown_fields_and_nonpositive_sizes_are_rejected() -> None:
    with pytest.raises(pydantic.ValidationError):
        ParallelConfig(hsdp_shard=4)
    with pytest.raises(pydantic.ValidationError):
        ParallelConfig(hsdp_shard_group=0)


def test_shard_group_not_dividing_world_names_field_and_divisors() -> None:
    with pytest.raises(RecipeError) as e:
        ParallelConfig(workers=4, hsdp_shard_group=3).validate_against_world()
    assert "parallel.hsdp_shard_group=3" in e.value.problem
    assert "parallel.workers=4" in e.value.problem
    assert "(1, 2, 4)" in e.value.fix


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"embedding_group": 6}, "parallel.embedding_group=6"),
        ({"gpus_per_host": 8, "workers": 12}, "parallel.gpus_per_host=8"),
        ({"gpus_per_host": 8, "workers": 16, "expert_parallel": 3}, "parallel.expert_parallel=3"),
        ({"gpus_per_host": 8, "workers": 48, "expert_shard_hosts": 4}, "expert_shard_hosts=4"),
    ],
)
def test_each_size_is_checked(fields: dict, named: str) -> None:
    with pytest.raises(RecipeError, match=named.replace(".", r"\.")):
        ParallelConfig(**fields).validate_against_world()


def test_world_argument_overrides_workers() -> None:
    p = ParallelConfig(workers=2, gpus_per_host=8, hsdp_shard_group=128, embedding_group=256)
    p.validate_against_world(4096)
    with pytest.raises(RecipeError, match="parallel.workers=2"):
        p.validate_against_world()


def test_large_divisor_lists_are_elided() -> None:
    with pytest.raises(RecipeError) as e:
        ParallelConfig(workers=4096, hsdp_shard_group=100).validate_against_world()
    assert "..." in e.value.fix and "4096)" in e.value.fix
