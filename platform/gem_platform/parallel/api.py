"""The seam between the training loop and the parallelism strategies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from gem_platform.errors import RecipeError
from gem_platform.parallel.clip import clip_grad_norm
from gem_platform.parallel.data_parallel import all_reduce_gradients, broadcast_parameters
from gem_platform.recipe import Recipe
from gem_platform.topology import GroupKind, ParallelConfig

if TYPE_CHECKING:
    from gem_platform.parallel.host_split import HostSplitTables
    from gem_platform.parallel.mesh import RankGroups
    from gem_platform.parallel.sparse_pipeline import SparseInputPipeline


@dataclass
class Parallelized:
    """A model ready to train on this rank.

    ``sync_gradients`` runs after backward and before the optimizer steps: it averages the
    gradients that the strategy leaves replicated (FSDP-sharded parameters reduce their own
    during backward, so it is a no-op for them).

    ``sparse_optimizer`` is set when TorchRec shards the embedding tables: they then train with
    its fused optimizer (updated inside backward; ``step``/``zero_grad`` are harmless) and
    ``sparse_params`` is empty. ``clip_grad_norm_`` clips by the global norm whatever mesh each
    gradient lives on. ``sparse_pipeline``, where tables are sharded over several ranks,
    starts a batch's input distribution one step ahead (train.pipeline_sparse).
    ``host_split`` holds the tables split over the ranks of each host
    (parallel.embedding_host_split): ``sparse_params`` are then its pieces, whose gradients
    ``sync_gradients`` reduce-scatters, and ``after_optimizer_step`` starts the next
    step's all-gather.
    """

    model: nn.Module
    dense_params: list[nn.Parameter]
    sparse_params: list[nn.Parameter]
    replicated_params: list[nn.Parameter] = field(default_factory=list)
    world_size: int = 1
    strategy: str = "data_parallel"
    sparse_optimizer: torch.optim.Optimizer | None = None
    expert_params: list[nn.Parameter] = field(default_factory=list)
    expert_group: dist.ProcessGroup | None = None
    replica_sync: Callable[[], None] | None = None
    sparse_pipeline: SparseInputPipeline | None = None
    host_split: HostSplitTables | None = None

    @property
    def fused_sparse(self) -> bool:
        """True when the embedding tables are updated by TorchRec's fused optimizer."""
        return self.sparse_optimizer is not None

    def sync_gradients(self) -> None:
        all_reduce_gradients(self.replicated_params, self.world_size)
        if self.host_split is not None:
            self.host_split.reduce_gradients()

    def after_optimizer_step(self) -> None:
        """Average the embedding-table replicas across embedding groups (2-D sparse
        parallelism), or start the next step's all-gather of host-split tables; nothing to
        do for the other strategies."""
        if self.replica_sync is not None:
            self.replica_sync()
        if self.host_split is not None:
            self.host_split.prefetch()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip dense and expert gradients by their global L2 norm (same on every rank)."""
        return clip_grad_norm(self.dense_params, self.expert_params, self.expert_group, max_norm)


@dataclass(frozen=True)
class StrategyChoice:
    """Which strategies the recipe's ``parallel:`` section turns on."""

    hsdp: bool
    expert_parallel: bool
    shard_embeddings: bool
    host_split: bool = False

    @classmethod
    def from_config(cls, parallel: ParallelConfig) -> StrategyChoice:
        """HSDP when a shard group size is given; expert parallelism when its size is above 1;
        TorchRec sharding when a layout or an embedding group is given."""
        return cls(
            hsdp=parallel.hsdp_shard_group is not None,
            expert_parallel=parallel.expert_parallel > 1,
            shard_embeddings=(parallel.embedding_sharding != "auto"
                              or parallel.embedding_group is not None),
            host_split=parallel.embedding_host_split,
        )

    @property
    def name(self) -> str:
        parts = [n for n, on in (("hsdp", self.hsdp), ("expert_parallel", self.expert_parallel),
                                 ("torchrec_sharding", self.shard_embeddings),
                                 ("embedding_host_split", self.host_split)) if on]
        return "+".join(parts) or "data_parallel"


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def parallelize(model: nn.Module, recipe: Recipe) -> Parallelized:
    """Spread ``model`` over the ranks as ``recipe.parallel`` asks.

    One process: the whole model here, its tables through TorchRec's fused path where that
    runs (see ``_single_process``). Several processes with no parallel sizes set: plain data
    parallelism, every rank holds the whole model and its gradients are all-reduced in one
    flat bucket after backward (``sync_gradients``, timed apart from compute for Local MFU).
    """
    world = _world()
    choice = StrategyChoice.from_config(recipe.parallel)
    broadcast_parameters(model)
    if world == 1:
        return _single_process(model, recipe, choice)
    if choice.name == "data_parallel":
        return _data_parallel(model, world)
    if choice.host_split:
        return _host_split(model, recipe, choice, world)
    return _compose(model, recipe, choice, world)


def _single_process(model: nn.Module, recipe: Recipe, choice: StrategyChoice) -> Parallelized:
    """One process: the whole dense model here; tables through TorchRec's fused path (one-rank
    DistributedModelParallel, table-wise unless a layout is asked for) on CUDA where
    fbgemm-gpu's CUDA build runs, or where a one-worker recipe asks for a layout; else plain
    (dense). A multi-worker recipe run in one process (--local) keeps the whole model."""
    from gem_platform.parallel.single import (
        ensure_process_group,
        wants_fused_tables,
        warn_dense_tables,
    )

    device = next(model.parameters()).device
    asked = choice.shard_embeddings and recipe.parallel.workers == 1
    if not wants_fused_tables(device, asked):
        warn_dense_tables(list(model.embedding_parameters()), device)
        return _data_parallel(model, 1)
    from gem_platform.parallel.embeddings import EmbeddingShardingSpec, shard_embeddings

    layout = recipe.parallel.embedding_sharding
    spec = EmbeddingShardingSpec("table_wise" if layout == "auto" else layout, 1,
                                 recipe.train.sparse_lr, device.type, recipe.train.sparse_eps)
    inner = shard_embeddings(model, spec, ensure_process_group(device), device)
    table_ids = {id(p) for p in inner.module.embedding_parameters()}
    dense = [p for p in inner.module.parameters() if id(p) not in table_ids]
    return Parallelized(model=inner.module, dense_params=dense, sparse_params=[],
                        strategy="torchrec_sharding", sparse_optimizer=inner.fused_optimizer)


def _data_parallel(model: nn.Module, world: int) -> Parallelized:
    sparse = list(model.embedding_parameters())
    sparse_ids = {id(p) for p in sparse}
    dense = [p for p in model.parameters() if id(p) not in sparse_ids]
    return Parallelized(model=model, dense_params=dense, sparse_params=sparse,
                        replicated_params=[*dense, *sparse], world_size=world)


def _host_split(model: nn.Module, recipe: Recipe, choice: StrategyChoice,
                world: int) -> Parallelized:
    """Replicated tables split over the ranks of each host, dense parameters data parallel
    (gem_platform.parallel.host_split)."""
    from gem_platform.parallel.host_split import HostSplitTables, build_split_groups
    from gem_platform.parallel.mesh import topology_mesh

    recipe.parallel.check_host_split_trained()
    mesh = topology_mesh(recipe.parallel, world)
    hosts = [list(g.ranks) for g in mesh[GroupKind.EMBEDDING_HOST].groups]
    device = next(model.parameters()).device
    split = HostSplitTables.apply(model, build_split_groups(hosts, device.type), world)
    pieces = {id(p) for p in split.shards}
    dense = [p for p in model.parameters() if id(p) not in pieces]
    return Parallelized(model=model, dense_params=dense, sparse_params=list(split.shards),
                        replicated_params=dense, world_size=world, strategy=choice.name,
                        host_split=split)


@dataclass
class _ShardedTables:
    """What TorchRec sharding leaves: the module to train on, its fused optimizer, and the
    replica averaging of 2-D sparse parallelism (None when the tables have one copy)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    replica_sync: Callable[[], None] | None = None


def _compose(model: nn.Module, recipe: Recipe, choice: StrategyChoice,
             world: int) -> Parallelized:
    """Embeddings first (the planner sees plain TorchRec modules), then experts on their own
    meshes, then HSDP over what is left of the dense part."""
    from gem_platform.parallel.mesh import build_rank_groups

    groups = build_rank_groups(recipe.parallel)
    device = next(model.parameters()).device
    sharded = (_shard_tables(model, recipe, groups, world, device) if choice.shard_embeddings
               else _ShardedTables(model))
    inner = sharded.module
    expert_params: list[nn.Parameter] = []
    expert_group = None
    if choice.expert_parallel:
        expert_group = groups.group(GroupKind.EXPERT)
        expert_params = _place_experts(inner, groups, expert_group, world, device)

    tables = list(inner.embedding_parameters())
    if choice.hsdp:
        from gem_platform.parallel.hsdp import apply_hsdp
        from gem_platform.parallel.mesh import hsdp_device_mesh

        apply_hsdp(inner, hsdp_device_mesh(groups, device.type), ignored=tables)

    table_ids = {id(p) for p in tables}
    expert_ids = {id(p) for p in expert_params}
    dense = [p for p in inner.parameters() if id(p) not in table_ids]
    plain_dense = [] if choice.hsdp else [p for p in dense if id(p) not in expert_ids]
    sparse = [] if choice.shard_embeddings else tables
    pipeline = None
    if choice.shard_embeddings and recipe.train.pipeline_sparse:
        from gem_platform.parallel.sparse_pipeline import SparseInputPipeline

        pipeline = SparseInputPipeline.for_model(inner)
    return Parallelized(
        model=inner, dense_params=dense, sparse_params=sparse,
        replicated_params=[*plain_dense, *sparse], world_size=world, strategy=choice.name,
        sparse_optimizer=sharded.optimizer, expert_params=expert_params,
        expert_group=expert_group, replica_sync=sharded.replica_sync,
        sparse_pipeline=pipeline)


def _shard_tables(model: nn.Module, recipe: Recipe, groups: RankGroups, world: int,
                  device: torch.device) -> _ShardedTables:
    """Shard the embedding tables with TorchRec over each embedding group: one copy over all
    ranks, or (CUDA only) one copy per group, replicated across groups."""
    from gem_platform.parallel.embeddings import (
        EmbeddingShardingSpec,
        shard_embeddings,
        shard_embeddings_replicated,
    )

    size = len(groups.ranks(GroupKind.EMBEDDING))
    spec = EmbeddingShardingSpec(recipe.parallel.embedding_sharding, size,
                                 recipe.train.sparse_lr, device.type, recipe.train.sparse_eps)
    replica_sync = None
    if size == world:
        dmp = shard_embeddings(model, spec, groups.group(GroupKind.EMBEDDING), device)
    elif device.type != "cuda":
        raise RecipeError(
            f"parallel.embedding_group={size} is smaller than parallel.workers={world}: "
            "tables sharded per group and replicated across groups use TorchRec's "
            "DMPCollection, which runs on CUDA only.",
            "Leave parallel.embedding_group unset on CPU (one copy sharded over all "
            "workers), or run on GPUs (parallel.use_gpu: true).",
        )
    else:
        dmp = shard_embeddings_replicated(model, spec, world, device)
        replica_sync = dmp.sync
    # Train DMP's inner module: DMP's forward only calls it, and its parameter names are
    # the unsharded model's, which torch.distributed.checkpoint resolves against.
    return _ShardedTables(dmp.module, dmp.fused_optimizer, replica_sync)


def _place_experts(inner: nn.Module, groups: RankGroups, expert_group: dist.ProcessGroup,
                   world: int, device: torch.device) -> list[nn.Parameter]:
    """One DHEN expert per rank of this rank's expert group, each FSDP-sharded over its own
    mesh; returns the expert parameters."""
    from gem_platform.parallel.experts import apply_expert_parallel
    from gem_platform.parallel.mesh import expert_device_mesh

    ranks = groups.ranks(GroupKind.EXPERT)
    return apply_expert_parallel(inner, expert_group, ranks.index(groups.rank),
                                 expert_device_mesh(groups, device.type), world)
