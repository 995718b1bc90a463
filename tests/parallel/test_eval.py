"""Evaluation when the model's forward is a collective (TorchRec-sharded tables, HSDP, expert
exchange): every rank must run the same number of eval batches, or the ranks with more wait
forever for the others. Here the ranks hold eval sets of different sizes (3 and 2 batches,
partial last batches of different sizes); the metrics equal one process scoring the union."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import yaml

from gem_platform.data.parquet import SampleTable
from gem_platform.data.prepare import prepare_dataset
from gem_platform.recipe import Recipe, recipe_from_dict
from tests.parallel.harness import spawn
from tests.tiny_training import TINY

WORLD = 2
SIZES = (37, 20)  # eval samples per rank; local batch 16: 3 and 2 batches
PARALLEL = {
    "table_wise": {"workers": WORLD, "embedding_sharding": "table_wise"},
    "hsdp_experts": {"workers": WORLD, "gpus_per_host": 2, "hsdp_shard_group": 2,
                     "expert_parallel": 2},
}


def eval_recipe(data: Path, parallel: dict) -> Recipe:
    tree = yaml.safe_load(TINY.format(data=data))
    tree["model"]["num_experts"] = 2
    tree["loader"].update(local_batch_size=16, base_batch_size=8)
    tree["parallel"] = parallel
    return recipe_from_dict(tree)


def rank_table(data: Path, start: int, stop: int) -> SampleTable:
    full = SampleTable.load(data, "eval")
    return SampleTable(full.meta, full.arrays.slice(start, stop))


def _evaluate_on_share(data: Path, rank: int, world: int) -> dict[str, dict[str, float]]:
    from gem_platform.parallel import parallelize
    from gem_platform.train.loop import RankInfo, build_model, evaluate

    start = sum(SIZES[:rank])
    table = rank_table(data, start, start + SIZES[rank])
    out = {}
    for name, parallel in PARALLEL.items():
        recipe = eval_recipe(data, parallel)
        par = parallelize(build_model(recipe, table.meta, torch.device("cpu")), recipe)
        out[name] = evaluate(par.model, table, recipe, torch.device("cpu"), RankInfo.current())
    return out


@pytest.mark.slow
def test_uneven_eval_split_runs_the_same_batches_everywhere(tmp_path):
    from gem_platform.train.loop import RankInfo, build_model, evaluate

    data = tmp_path / "data"
    recipe = eval_recipe(data, {"workers": 1})
    meta = prepare_dataset(recipe.data)
    assert meta.num_eval >= sum(SIZES)
    results = spawn(functools.partial(_evaluate_on_share, data), WORLD)

    union = rank_table(data, 0, sum(SIZES))
    cpu = torch.device("cpu")
    expected = evaluate(build_model(recipe, meta, cpu), union, recipe, cpu, RankInfo())
    assert expected["eval/count_ctr"] == sum(SIZES)  # padded samples are not counted
    for name in PARALLEL:
        for r in results:
            got = r[name]
            assert got["eval/count_ctr"] == expected["eval/count_ctr"], name
            assert got["eval/count_cvr"] == expected["eval/count_cvr"], name
            for key in ("eval/ne_ctr", "eval/auc_ctr", "eval/ne_cvr", "eval/logloss_cvr"):
                assert got[key] == pytest.approx(expected[key], rel=1e-5), (name, key)
