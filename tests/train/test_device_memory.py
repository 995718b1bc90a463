"""A run whose device runs out of memory ends with an error that names the phase and the
recipe fields that lower the peak, not the allocator's traceback. CPUs can't run a CUDA device
out of memory, so the out-of-memory error is raised where the device would raise it: in a
training step, and while the run is set up."""

from __future__ import annotations

import pytest
import torch

import gem_platform.train.loop as loop
from gem_platform.errors import GemError
from gem_platform.recipe import recipe_from_dict
from gem_platform.train.device_memory import (
    DeviceMemoryError,
    explained_out_of_memory,
    memory_fixes,
)
from gem_platform.train.regions import CheckpointPlan
from tests.tiny_training import tiny_tree

ALLOCATOR = "CUDA out of memory. Tried to allocate 762.00 MiB. GPU 0 has a total capacity"


def _oom_at(step: int, real: object):
    def launch(run, batch, at, *args, **kwargs):
        if at == step:
            raise torch.OutOfMemoryError(ALLOCATOR)
        return real(run, batch, at, *args, **kwargs)
    return launch


def test_a_step_out_of_memory_names_the_fields_that_lower_the_peak(tmp_path, monkeypatch):
    recipe = recipe_from_dict(tiny_tree(tmp_path / "data", seq_layers=1, steps=4))
    monkeypatch.setattr(loop, "launch_step", _oom_at(3, loop.launch_step))
    with pytest.raises(DeviceMemoryError) as caught:
        loop.train(recipe, echo=lambda _: None)
    err = caught.value
    assert isinstance(err, GemError) and isinstance(err, MemoryError)
    assert isinstance(err.__cause__, torch.OutOfMemoryError)
    assert "Recipe 'tiny' ran out of device memory while training" in err.problem
    assert "Tried to allocate 762.00 MiB" in err.problem
    assert "set train.activation_memory_gb" in err.fix  # the recipe set none
    assert "loader.local_batch_size (now 128)" in err.fix


def test_set_up_out_of_memory_says_so(tmp_path, monkeypatch):
    recipe = recipe_from_dict(tiny_tree(tmp_path / "data", seq_layers=1, steps=2))

    def setup(*args, **kwargs):
        raise torch.OutOfMemoryError(ALLOCATOR)

    monkeypatch.setattr(loop, "setup", setup)
    with pytest.raises(DeviceMemoryError, match="while setting up the run"):
        loop.train(recipe, echo=lambda _: None)


def test_a_set_budget_is_named_with_what_the_plan_kept(tmp_path, monkeypatch):
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=2)
    tree["train"]["activation_memory_gb"] = 60
    recipe = recipe_from_dict(tree)
    plan = CheckpointPlan(recompute=["sequence.blocks.0"], kept_gb=58.5, full_gb=78.5,
                          budget_gb=60)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    # fragmented: the free fix first, then the budget
    fixes = memory_fixes(recipe, plan, fragmented_gib=4.6)
    assert fixes.startswith("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (4.6 GiB sit "
                            "reserved but unallocated"), fixes
    assert "; or lower train.activation_memory_gb (now 60; the plan kept ~58.5 GB)" in fixes
    assert memory_fixes(recipe, plan, fragmented_gib=0.5).startswith(
        "lower train.activation_memory_gb (now 60; the plan kept ~58.5 GB)")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert memory_fixes(recipe, plan, fragmented_gib=4.6).startswith(
        "lower train.activation_memory_gb")
    with pytest.raises(DeviceMemoryError) as caught, \
            explained_out_of_memory(recipe, torch.device("cpu"), "while training", plan):
        raise torch.OutOfMemoryError(ALLOCATOR)
    assert "Activation plan: activations ~78.5 GB -> ~58.5 GB kept" in caught.value.problem


def test_other_errors_pass_through(tmp_path):
    recipe = recipe_from_dict(tiny_tree(tmp_path / "data", seq_layers=1, steps=2))
    with pytest.raises(ValueError, match="not memory"), \
            explained_out_of_memory(recipe, torch.device("cpu"), "while training"):
        raise ValueError("not memory")
