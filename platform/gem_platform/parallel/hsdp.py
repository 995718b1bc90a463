"""HSDP: FSDP2 over a 2-D (replicate, shard) mesh for the dense part of GemModel.

Each dense block (every sequence block, cross and pooled attention, every DHEN layer, the head)
is one FSDP unit: its parameters are all-gathered inside the shard group just before it runs
and freed after; gradients are reduce-scattered inside the shard group and all-reduced across
the replicate groups. A shard group of 1 leaves full replicas (DDP-like); a replicate group of 1
is plain FSDP. Embedding tables are never FSDP-managed: they stay replicated or go to TorchRec.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def dense_blocks(model: nn.Module) -> list[nn.Module]:
    """The FSDP units of a GemModel, in forward order."""
    return [*model.sequence.blocks, model.cross, model.pooled, *model.dhen, model.head]


def apply_hsdp(model: nn.Module, mesh: DeviceMesh, ignored: Iterable[nn.Parameter]) -> nn.Module:
    """Shard ``model``'s dense blocks in place over ``mesh``; the root unit takes the remaining
    small dense parameters (input projections, final norm). ``ignored`` parameters (embedding
    tables) are left to another strategy. Submodules already sharded (experts on their own
    mesh) keep their own units."""
    ignored_set = set(ignored)
    for block in dense_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=ignored_set)
    return model
