"""Tables of a single-process run through TorchRec's fused path (one-rank
DistributedModelParallel, FBGEMM's TBE with Adagrad in the backward): on CPU when a layout is
asked for, on CUDA by default where fbgemm-gpu's CUDA build runs. Checkpoints and resume keep
working on that path; the dense fallback says what it costs."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import yaml

from gem_platform.checkpoint.store import LocalStore, latest_checkpoint
from gem_platform.data.prepare import prepare_dataset
from gem_platform.parallel import parallelize
from gem_platform.parallel.single import (
    dense_table_cost,
    fused_tbe_available,
    plain_tables,
    wants_fused_tables,
    warn_dense_tables,
)
from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import build_model, train
from gem_platform.train.optim import dense_optimizer
from tests.tiny_training import TINY


@pytest.fixture
def one_rank_recipe(tmp_path, monkeypatch):
    """TINY in one process with table-wise tables; the one-rank group is torn down after."""
    monkeypatch.chdir(tmp_path)
    tree = yaml.safe_load(TINY.format(data=tmp_path / "data"))
    tree["train"].update(steps=6, log_every=1, perf_warmup_steps=1)
    tree["parallel"] = {"workers": 1, "embedding_sharding": "table_wise"}
    yield tmp_path, tree
    if dist.is_initialized():
        dist.destroy_process_group()


def test_one_process_trains_tables_in_the_backward(one_rank_recipe):
    _, tree = one_rank_recipe
    recipe = recipe_from_dict(tree)
    meta = prepare_dataset(recipe.data)
    par = parallelize(build_model(recipe, meta, torch.device("cpu")), recipe)
    assert par.fused_sparse and par.sparse_params == [] and par.strategy == "torchrec_sharding"
    assert dist.get_world_size() == 1
    table_ids = {id(p) for p in par.model.embedding_parameters()}
    assert table_ids and not table_ids & {id(p) for p in par.dense_params}
    # the dense side covers every non-table parameter of the model
    assert len(par.dense_params) + len(table_ids) == len(list(par.model.parameters()))


def test_one_process_fused_tables_resume_exactly(one_rank_recipe):
    d, tree = one_rank_recipe
    recipe = recipe_from_dict(tree)
    straight: list[float] = []
    train(recipe, sink=lambda m, s: straight.append(m["train/loss"]) if "train/loss" in m
          else None, echo=lambda _: None)

    class Crash(Exception):
        pass

    logged: list[float] = []

    def crashing(metrics, step):
        if "train/loss" in metrics:
            logged.append(metrics["train/loss"])
            if step == 5:
                raise Crash

    store = LocalStore(d / "ckpts", every=2, keep=2)
    with pytest.raises(Crash):
        train(recipe, sink=crashing, echo=lambda _: None, checkpoints=store)
    assert latest_checkpoint(d / "ckpts").name == "step_00000004"
    resumed: list[float] = []
    train(recipe, sink=lambda m, s: resumed.append(m["train/loss"]) if "train/loss" in m
          else None, echo=lambda _: None, checkpoints=store)
    assert len(straight) == 6 and len(set(straight)) == 6
    assert logged[:4] == pytest.approx(straight[:4], rel=1e-6)
    assert resumed == pytest.approx(straight[4:], rel=1e-5, abs=1e-6)


def test_which_path_a_single_process_takes():
    cpu = torch.device("cpu")
    assert fused_tbe_available(cpu)
    assert not wants_fused_tables(cpu, sharding_requested=False)  # CPU default: plain tables
    assert wants_fused_tables(cpu, sharding_requested=True)
    if not torch.cuda.is_available():
        return
    cuda = torch.device("cuda")
    assert wants_fused_tables(cuda, False) == fused_tbe_available(cuda)


def test_dense_fallback_says_what_it_costs(caplog):
    tables = [torch.nn.Parameter(torch.zeros(1000, 8)), torch.nn.Parameter(torch.zeros(24, 8))]
    line = dense_table_cost(tables)
    assert "\n" not in line and "1,024 rows" in line and "fbgemm-gpu" in line
    with caplog.at_level(logging.WARNING):
        warn_dense_tables(tables, torch.device("cpu"))  # the only path on CPU: no warning
        assert not caplog.records
        warn_dense_tables(tables, torch.device("cuda"))
    if fused_tbe_available(torch.device("cuda")):  # the fused path runs: nothing to warn of
        assert not caplog.records
    else:
        assert [r.getMessage() for r in caplog.records] == [line]
    with plain_tables():
        assert not wants_fused_tables(torch.device("cpu"), sharding_requested=True)
    assert wants_fused_tables(torch.device("cpu"), sharding_requested=True)


def test_dense_optimizer_is_fused_on_cuda_only():
    cfg = recipe_from_dict({}).train
    cpu_opt = dense_optimizer([torch.nn.Parameter(torch.ones(3))], cfg, torch.device("cpu"))
    assert not cpu_opt.defaults["fused"]
    assert cpu_opt.defaults["lr"] == cfg.lr and cpu_opt.defaults["weight_decay"] == cfg.weight_decay


@pytest.mark.gpu
def test_dense_optimizer_fused_on_cuda():
    cfg = recipe_from_dict({}).train
    p = torch.nn.Parameter(torch.ones(3, device="cuda"))
    opt = dense_optimizer([p], cfg, torch.device("cuda"))
    assert opt.defaults["fused"]
    p.grad = torch.ones_like(p)
    opt.step()
    assert (p < 1).all()


def test_wide_tables_train_on_the_fused_path(one_rank_recipe):
    """model.wide through TorchRec's one-rank DistributedModelParallel: the wide tables are
    sharded beside the others (their zero start carried over) and trained in the backward."""
    _, tree = one_rank_recipe
    tree["model"]["wide"] = True
    recipe = recipe_from_dict(tree)
    held = {}
    train(recipe, echo=lambda _: None, on_step=lambda _, m: held.__setitem__("model", m))
    state = held["model"].wide_embeddings.state_dict()
    local = {name: w.local_shards()[0].tensor for name, w in state.items()}
    meta = prepare_dataset(recipe.data)
    assert len(local) == len(meta.sparse_features) + 1 + (meta.num_categories > 0)
    moved = [name for name, w in local.items() if w.abs().sum() > 0]
    assert sorted(moved) == sorted(local), "wide tables the fused optimizer never stepped"
