"""Expert parallelism for the DHEN layers.

The ranks of one expert group (GPUs of a host) each hold a different share of every DhenLayer's
MLP experts. In each layer every rank sends its samples' flattened tokens to all ranks of the
group (all_to_all), runs its own experts on the samples of the whole group, and sends each rank
the sum of its experts' outputs for that rank's samples (all_to_all back). Summed over the
group, that is the sum over all experts, which the layer adds to its residual update exactly
as before. Both exchanges are differentiable, so gradients flow back to the senders and each
expert's gradient collects the samples of the whole group.

An expert's parameters live on its holders only: they are FSDP-sharded over the expert shard
group and their gradients averaged over the expert replicate group (FSDP2 on a 2-D mesh).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from gem_platform.errors import RecipeError
from gem_platform.model.interaction import DhenLayer


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    out = rows.new_empty(sum(out_splits), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all of rows whose backward sends the row gradients back the way they came."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def all_to_all_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all_to_all: ``in_splits[j]`` rows go to rank j of ``group``,
    ``out_splits[j]`` rows come from it."""
    return _AllToAll.apply(rows, out_splits, in_splits, group)


class LocalExperts(nn.Module):
    """The experts of one DhenLayer held by this rank; returns the sum of their outputs.

    Each expert keeps its index in the whole layer as its name, so its parameters have the
    same name on every rank that holds it and a different one on ranks that hold another
    expert: distributed checkpoints key tensors by name, and a name shared by different
    experts would store one rank's expert (and its optimizer state) for all of them."""

    def __init__(self, experts: dict[int, nn.Module]) -> None:
        super().__init__()
        self.experts = nn.ModuleDict({str(i): e for i, e in experts.items()})

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        experts = list(self.experts.values())
        out = experts[0](flat)
        for expert in experts[1:]:
            out = out + expert(flat)
        return out


class ExpertExchange(nn.Module):
    """Stands in for a DhenLayer's expert list: (b, F) tokens -> (b, F) sum over all experts of
    the group, computed where each expert lives."""

    def __init__(self, local: LocalExperts, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.local = local
        self.group = group
        self.size = dist.get_world_size(group)

    def _batch_sizes(self, b: int, device: torch.device) -> list[int]:
        sizes = torch.empty(self.size, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(sizes, torch.tensor([b], dtype=torch.int64, device=device),
                                    group=self.group)
        return sizes.tolist()

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        b, width = flat.shape
        sizes = self._batch_sizes(b, flat.device)
        mine = [b] * self.size
        # every rank of the group receives this rank's rows
        gathered = all_to_all_rows(flat.repeat(self.size, 1), sizes, mine, self.group)
        partial = self.local(gathered)
        # each rank gets back, from every rank, that rank's experts' sum over its own rows
        returned = all_to_all_rows(partial, mine, sizes, self.group)
        return returned.view(self.size, b, width).sum(0)


def expert_share(num_experts: int, group_size: int, position: int) -> range:
    """Indices of the experts that position ``position`` of an expert group holds."""
    if num_experts % group_size != 0:
        raise RecipeError(
            f"model.num_experts={num_experts} cannot be split evenly over "
            f"parallel.expert_parallel={group_size} ranks.",
            f"Set model.num_experts to a multiple of {group_size}, or expert_parallel to a "
            f"divisor of {num_experts}.",
        )
    per_rank = num_experts // group_size
    return range(position * per_rank, (position + 1) * per_rank)


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup, position: int,
                          mesh: DeviceMesh, world: int) -> list[nn.Parameter]:
    """Keep this rank's share of every DhenLayer's experts, behind an exchange over ``group``;
    shard them with FSDP2 over ``mesh`` (expert replicate x expert shard). Returns the expert
    parameters this rank now holds.

    Each holder's gradient is the sum over the samples of its expert group; summing over all
    holders (the mesh) and dividing by the world size gives the data-parallel mean.
    """
    size = dist.get_world_size(group)
    params: list[nn.Parameter] = []
    for layer in model.modules():
        if not isinstance(layer, DhenLayer):
            continue
        share = expert_share(layer.num_experts, size, position)
        local = LocalExperts({i: layer.experts[i] for i in share})
        fully_shard(local, mesh=mesh)
        local.set_gradient_divide_factor(float(world))
        if mesh["shard"].size() > 1:
            # a custom factor reduce-scatters with PREMUL_SUM, which gloo lacks: SUM, then
            # divide. (Not on a 1-rank shard group: FSDP2 already divides there, once.)
            local.set_force_sum_reduction_for_comms(True)
        layer.experts = nn.ModuleList([ExpertExchange(local, group)])
        params += list(local.parameters())
    return params
