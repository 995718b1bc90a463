"""The seam between the training loop and the parallelism strategies."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from gem_platform.parallel.data_parallel import all_reduce_gradients, broadcast_parameters
from gem_platform.recipe import Recipe


@dataclass
class Parallelized:
    """A model ready to train on this rank.

    ``sync_gradients`` runs after backward and before the optimizer steps: it averages the
    gradients that the strategy leaves replicated (FSDP-sharded parameters reduce their own).
    """

    model: nn.Module
    dense_params: list[nn.Parameter]
    sparse_params: list[nn.Parameter]
    replicated_params: list[nn.Parameter] = field(default_factory=list)
    world_size: int = 1
    strategy: str = "data_parallel"

    def sync_gradients(self) -> None:
        all_reduce_gradients(self.replicated_params, self.world_size)


def parallelize(model: nn.Module, recipe: Recipe) -> Parallelized:
    """Plain data parallelism: every rank holds the whole model; gradients are all-reduced in
    one flat bucket after backward, timed apart from compute for Local MFU."""
    del recipe
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    broadcast_parameters(model)
    sparse = list(model.embedding_parameters())
    sparse_ids = {id(p) for p in sparse}
    dense = [p for p in model.parameters() if id(p) not in sparse_ids]
    return Parallelized(model=model, dense_params=dense, sparse_params=sparse,
                        replicated_params=[*dense, *sparse], world_size=world)
