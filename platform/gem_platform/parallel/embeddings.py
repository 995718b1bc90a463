"""Embedding tables sharded by TorchRec: a planner-made plan, DistributedModelParallel.

The planner sees the model's EmbeddingCollection (items) and EmbeddingBagCollection (sparse
features) and places every table on the ranks of the embedding group under the recipe's
``parallel.embedding_sharding`` constraint. The sharded modules keep the unsharded interface
(a KeyedJaggedTensor in, lazily awaited embeddings out), so GemModel's forward is unchanged.

Tables train with TorchRec's fused optimizer (exact Adagrad, applied inside the backward of the
lookup), so they expose no parameters to an outside optimizer. Gradients reaching a table are
summed over the ranks of the group (TorchRec's convention) where data parallelism averages;
Adagrad divides by the root of the accumulated squares, so that constant factor cancels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel, DMPCollection
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from gem_platform.parallel.recat_cache import install as cache_torchrec_recat
from gem_platform.topology.config import EmbeddingSharding

# TorchRec offers row-wise layouts only for CUDA and MTIA devices; on CPU the row-wise lookup
# (bucketize ids by row range, all_to_all, fused CPU kernel) works all the same.
_ROW_TYPES = [ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value]
ADAGRAD_EPS = 1e-10  # torch.optim.Adagrad's default; recipes set train.sparse_eps


class _CpuRowWiseMixin:
    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)  # type: ignore[misc]
        return list(dict.fromkeys([*types, *_ROW_TYPES]))


class CollectionSharder(_CpuRowWiseMixin, EmbeddingCollectionSharder):
    """EmbeddingCollection sharder that also offers row-wise layouts on CPU."""


class BagCollectionSharder(_CpuRowWiseMixin, EmbeddingBagCollectionSharder):
    """EmbeddingBagCollection sharder that also offers row-wise layouts on CPU."""


@dataclass(frozen=True)
class EmbeddingShardingSpec:
    """What the planner is asked for: the layout, the group and the fused optimizer."""

    sharding: EmbeddingSharding
    group_size: int
    learning_rate: float
    compute_device: str = "cpu"
    eps: float = ADAGRAD_EPS

    def fused_params(self) -> dict[str, object]:
        return {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": self.learning_rate,
                "eps": self.eps}

    def sharders(self) -> list:
        fused = self.fused_params()
        return [CollectionSharder(fused_params=fused), BagCollectionSharder(fused_params=fused)]


def table_names(model: nn.Module) -> list[str]:
    """Names of every embedding table in the model (the planner's constraint keys)."""
    names: list[str] = []
    for module in model.modules():
        if isinstance(module, EmbeddingCollection):
            names += [t.name for t in module.embedding_configs()]
        elif isinstance(module, EmbeddingBagCollection):
            names += [t.name for t in module.embedding_bag_configs()]
    return names


def _topology(spec: EmbeddingShardingSpec) -> Topology:
    """The planner's view of the devices: on CUDA, the GPU's real memory (TorchRec assumes
    32 GiB, and plans tables that would fit in HBM through a UVM cache instead)."""
    kwargs = {}
    if spec.compute_device == "cuda" and torch.cuda.is_available():
        kwargs["hbm_cap"] = torch.cuda.get_device_properties(
            torch.cuda.current_device()).total_memory
    return Topology(world_size=spec.group_size, compute_device=spec.compute_device, **kwargs)


def make_plan(model: nn.Module, spec: EmbeddingShardingSpec,
              group: dist.ProcessGroup) -> ShardingPlan:
    """Plan on rank 0 of ``group`` and broadcast it, so every rank shards identically."""
    constraints = None
    if spec.sharding != "auto":
        constraints = {name: ParameterConstraints(sharding_types=[spec.sharding])
                       for name in table_names(model)}
    planner = EmbeddingShardingPlanner(topology=_topology(spec), constraints=constraints,
                                       debug=False)
    return planner.collective_plan(model, spec.sharders(), group)


def shard_embeddings(model: nn.Module, spec: EmbeddingShardingSpec, group: dist.ProcessGroup,
                     device: torch.device) -> DistributedModelParallel:
    """Wrap ``model`` in DistributedModelParallel over ``group``: embedding tables are sharded
    per the plan (their current weights carried over); dense modules are left untouched for
    the dense strategy (no DDP wrapper)."""
    cache_torchrec_recat()  # no host sync per batch in TorchRec's input all-to-all
    tables = {name: p.detach().clone() for name, p in _table_weights(model).items()}
    plan = make_plan(model, spec, group)
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(group), device=device, plan=plan,
        sharders=spec.sharders(), init_data_parallel=False, init_parameters=False)
    _load_table_weights(dmp, tables)
    return dmp


def shard_embeddings_replicated(model: nn.Module, spec: EmbeddingShardingSpec, world: int,
                                device: torch.device) -> DMPCollection:
    """2-D sparse parallelism: the tables are sharded over each embedding group of
    ``spec.group_size`` contiguous ranks and replicated across the ``world / group_size``
    groups, so all_to_all stays inside a group (a few hosts) and only the replicas' averaging
    crosses groups. TorchRec's DMPCollection does both; it runs on CUDA only, and its
    contiguous-group layout (``use_inter_host_allreduce``) is the one the topology plans.
    The caller averages the replicas after each optimizer step (``DMPCollection.sync``)."""
    cache_torchrec_recat()
    tables = {name: p.detach().clone() for name, p in _table_weights(model).items()}
    plan = make_plan(model, spec, dist.group.WORLD)
    dmp = DMPCollection(
        module=model, device=device, plan=plan, world_size=world,
        sharding_group_size=spec.group_size, global_pg=dist.group.WORLD,
        sharders=spec.sharders(), init_data_parallel=False, init_parameters=False,
        use_inter_host_allreduce=True)
    _load_table_weights(dmp, tables)
    return dmp


def _table_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state of every embedding collection in ``model`` (what sharding must carry over)."""
    prefixes = tuple(f"{name}." for name, m in model.named_modules()
                     if isinstance(m, (EmbeddingCollection, EmbeddingBagCollection)))
    return {k: v for k, v in model.state_dict().items() if k.startswith(prefixes)}


@torch.no_grad()
def _load_table_weights(dmp: DistributedModelParallel, tables: dict[str, torch.Tensor]) -> None:
    """Copy each rank's rows/columns of the original tables into its shards."""
    state = dmp.module.state_dict()
    for name, full in tables.items():
        sharded = state[name]
        for shard in sharded.local_shards():
            offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            shard.tensor.copy_(full[index])
