"""Shared pieces of the parallelism tests: a tiny GEM model and batches, a spawn helper, and
a training loop that uses ``Parallelized`` the way the product's loop does.

Each rank trains on its shard of one global batch; the mean of the ranks' losses then equals
the loss of a single process on the whole global batch when the shards are equal-sized and
hold the same number of clicks (the CVR loss averages over clicked samples).

Every recipe trains twice: with AdamW, as the product's loop does, and with plain SGD. Adam's
update barely changes when a gradient is scaled by a constant, so only the SGD run catches a
gradient averaged over the wrong number of ranks or a wrong global norm for clipping.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torchrec import KeyedJaggedTensor

from gem_platform.data.batch import JaggedBatch
from gem_platform.data.meta import DatasetMeta, SparseFeatureSpec
from gem_platform.recipe import Recipe
from tests.model_inputs import make_batch

STEPS = 3
OPTIMIZERS = ("adamw", "sgd")
SGD_LR = 0.2
SHARD_LENGTHS = [[3, 5, 2, 4], [6, 1, 2, 3], [2, 2, 7, 1], [4, 3, 3, 5]]


def tiny_meta() -> DatasetMeta:
    return DatasetMeta(
        source="synthetic", num_items=50, num_action_types=3,
        sparse_features=[SparseFeatureSpec("user_id", 20), SparseFeatureSpec("genre", 7, True)],
        dense_dim=3, num_train=0, num_eval=0, ctr_base_rate=0.2, cvr_base_rate=0.3,
    )


def tiny_recipe(**parallel: object) -> Recipe:
    """A small model (2 DHEN layers of 4 experts); ``parallel`` is the recipe's section. Grad
    clipping stays on (the product default) so that the global-norm path is exercised."""
    return Recipe.model_validate({
        "model": {"d_model": 16, "num_heads": 2, "seq_layers": 1, "pooled_queries": 2,
                  "sparse_dim": 8, "dhen_layers": 2, "num_experts": 4, "expert_hidden": 16,
                  "head_hidden": 16, "kernel": "pytorch"},
        "train": {"lr": 0.01, "sparse_lr": 0.05, "weight_decay": 0.0, "grad_clip": 1.0},
        "parallel": parallel,
    })


def shard_batch(meta: DatasetMeta, rank: int, step: int) -> JaggedBatch:
    """Rank ``rank``'s shard at ``step``: half of its samples clicked, CVR labels random."""
    lengths = SHARD_LENGTHS[rank % len(SHARD_LENGTHS)]
    batch = make_batch(meta, lengths, seed=1000 * step + rank)
    b = len(lengths)
    clicks = (torch.arange(b) % 2 == 0).float()
    labels = torch.stack([clicks, clicks * batch.labels[:, 1]], 1)
    return dataclasses.replace(batch, labels=labels)


def concat_batches(batches: list[JaggedBatch]) -> JaggedBatch:
    """One batch holding the samples of ``batches`` in order (the global batch)."""
    offsets = [batches[0].seq_offsets]
    for b in batches[1:]:
        offsets.append(b.seq_offsets[1:] + offsets[-1][-1])
    keys = batches[0].sparse.keys()
    per_key = [b.sparse.to_dict() for b in batches]
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat([d[k].values() for k in keys for d in per_key]),
        lengths=torch.cat([d[k].lengths() for k in keys for d in per_key]),
    )
    cat = lambda name: torch.cat([getattr(b, name) for b in batches])  # noqa: E731
    return JaggedBatch(
        seq_offsets=torch.cat(offsets), seq_item_ids=cat("seq_item_ids"),
        seq_action_types=cat("seq_action_types"), seq_age=cat("seq_age"),
        ad_item_id=cat("ad_item_id"), sparse=sparse, dense=cat("dense"), labels=cat("labels"),
    )


@dataclasses.dataclass
class RankRun:
    """What one rank saw: its losses, the strategy, and the mesh shapes its parameters live on
    (empty for plain tensors)."""

    losses: list[float]
    strategy: str
    meshes: set[tuple[int, ...]]
    num_sparse_params: int


def train_steps(recipe: Recipe, batches: list[JaggedBatch], optimizer: str = "adamw"
                ) -> RankRun:
    """Train a fresh model for ``len(batches)`` steps as the product's loop does (dense
    optimizer ``optimizer``)."""
    from gem_platform.parallel import parallelize
    from gem_platform.train.loop import build_model, compute_loss

    meta = tiny_meta()
    par = parallelize(build_model(recipe, meta, torch.device("cpu")), recipe)
    if optimizer == "sgd":
        dense_opt = torch.optim.SGD(par.dense_params, lr=SGD_LR)
    else:
        dense_opt = torch.optim.AdamW(par.dense_params, lr=recipe.train.lr,
                                      weight_decay=recipe.train.weight_decay)
    sparse_opt = par.sparse_optimizer or torch.optim.Adagrad(par.sparse_params,
                                                             lr=recipe.train.sparse_lr)
    losses = []
    for batch in batches:
        loss, _ = compute_loss(par.model(batch), batch)
        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        loss.backward()
        par.sync_gradients()
        par.clip_grad_norm_(recipe.train.grad_clip)
        dense_opt.step()
        sparse_opt.step()
        par.after_optimizer_step()
        losses.append(float(loss.detach()))
    meshes = {tuple(p.device_mesh.shape) for p in par.dense_params if isinstance(p, DTensor)}
    return RankRun(losses, par.strategy, meshes, len(par.sparse_params))


def reference_losses(recipe: Recipe, world: int, optimizer: str = "adamw",
                     steps: int = STEPS) -> list[float]:
    """One process on the global batches (all ranks' shards concatenated), default strategy."""
    meta = tiny_meta()
    single = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(
        update={"workers": 1, "hsdp_shard_group": None, "expert_parallel": 1,
                "embedding_sharding": "auto", "gpus_per_host": None})})
    batches = [concat_batches([shard_batch(meta, r, s) for r in range(world)])
               for s in range(steps)]
    return train_steps(single, batches, optimizer).losses


# Ranks start from a fork server that has imported these once (torch, TorchRec, the training
# code), so a rank costs a fork, not a fresh interpreter's imports; each rank is still a
# process of its own that has trained nothing. The server starts with the first spawn of a
# test process and serves all of that process's spawns.
START_METHOD = "forkserver"
PRELOAD = ["torch", "torchrec", "torch.distributed.checkpoint", "gem_platform.train.loop",
           "tests.parallel.harness"]


def _worker(rank: int, world: int, port: int, out_dir: str,
            job: Callable[[int, int], dict[tuple[str, str], RankRun]],
            cwd: str, env: dict[str, str]) -> None:
    # a forked rank has the fork server's folder and environment: take the test's
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(job(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(job: Callable[[int, int], dict[tuple[str, str], RankRun]], world: int
          ) -> list[dict[str, list[float]]]:
    """Run ``job(rank, world)`` in ``world`` gloo processes; returns each rank's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if START_METHOD == "forkserver":
        mp.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, port, d, job, os.getcwd(), dict(os.environ)),
                           nprocs=world, join=True, start_method=START_METHOD)
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


def run_recipes(recipes: dict[str, Recipe], rank: int, world: int
                ) -> dict[tuple[str, str], RankRun]:
    """Train every recipe with every optimizer on this rank's shards; the losses returned are
    the mean over ranks per step."""
    meta = tiny_meta()
    out = {}
    for name, recipe in recipes.items():
        for optimizer in OPTIMIZERS:
            run = train_steps(recipe, [shard_batch(meta, rank, s) for s in range(STEPS)],
                              optimizer)
            losses = torch.tensor(run.losses, dtype=torch.float64)
            dist.all_reduce(losses)
            run.losses = (losses / world).tolist()
            out[name, optimizer] = run
    return out


def assert_match_reference(results: list[dict[tuple[str, str], RankRun]],
                           recipes: dict[str, Recipe], world: int,
                           rel: float = 1e-5) -> None:
    """Every recipe's mean losses, with every optimizer, equal the single-process losses on the
    global batch (the model and data do not depend on the parallel section)."""
    any_recipe = next(iter(recipes.values()))
    for optimizer in OPTIMIZERS:
        expected = reference_losses(any_recipe, world, optimizer)
        assert len(set(expected)) == len(expected)  # training moved the loss
        for name in recipes:
            for r in results:
                got = r[name, optimizer].losses
                assert got == pytest.approx(expected, rel=rel, abs=1e-6), (name, optimizer)
