"""Which strategy a recipe's `parallel:` section selects, and the groups behind it (no
processes started)."""

from __future__ import annotations

from pathlib import Path

import torch

from gem_platform.model import GemModel
from gem_platform.parallel import parallelize
from gem_platform.parallel.api import StrategyChoice
from gem_platform.parallel.mesh import topology_mesh
from gem_platform.recipe import load_recipe
from gem_platform.topology import GroupKind, ParallelConfig
from tests.parallel.harness import tiny_meta, tiny_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_default_section_is_data_parallel():
    assert StrategyChoice.from_config(ParallelConfig()).name == "data_parallel"


def test_each_field_turns_its_strategy_on():
    assert StrategyChoice.from_config(ParallelConfig(workers=4, hsdp_shard_group=1)).name == (
        "hsdp")
    assert StrategyChoice.from_config(
        ParallelConfig(workers=4, gpus_per_host=2, expert_parallel=2)).name == "expert_parallel"
    assert StrategyChoice.from_config(
        ParallelConfig(workers=4, embedding_sharding="table_wise")).name == "torchrec_sharding"
    assert StrategyChoice.from_config(
        ParallelConfig(workers=4, embedding_group=4)).name == "torchrec_sharding"


def test_example_recipe_layout():
    recipe = load_recipe(RECIPES / "hsdp_cpu.yaml", [])
    choice = StrategyChoice.from_config(recipe.parallel)
    assert choice.name == "hsdp+expert_parallel+torchrec_sharding"
    mesh = topology_mesh(recipe.parallel, recipe.parallel.workers)
    assert mesh.hsdp_mesh_shape() == (2, 2)
    assert mesh[GroupKind.EXPERT].group_of(1).ranks == (0, 1)  # one host
    assert mesh[GroupKind.EXPERT_REPLICATE].group_of(1).ranks == (1, 3)  # expert 1's holders
    assert recipe.model.num_experts % recipe.parallel.expert_parallel == 0


def test_single_process_keeps_the_whole_model():
    recipe = tiny_recipe(workers=4, hsdp_shard_group=2, embedding_sharding="row_wise")
    model = GemModel(recipe.model, tiny_meta())
    par = parallelize(model, recipe)
    assert par.strategy == "data_parallel"
    assert par.model is model and par.sparse_optimizer is None
    n_tables = len(model.embedding_parameters())
    assert len(par.sparse_params) == n_tables
    assert len(par.dense_params) + n_tables == len(list(model.parameters()))
    par.sync_gradients()  # one rank: nothing to average
    assert float(par.clip_grad_norm_(1.0)) == 0.0  # no gradients yet
    assert all(not isinstance(p, torch.distributed.tensor.DTensor) for p in par.dense_params)
