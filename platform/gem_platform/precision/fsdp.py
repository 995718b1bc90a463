"""FP8 weight all-gather for FSDP2: quantize the local shard, gather FP8 bytes + scales.

``enable_fp8_all_gather(model)`` (call it before ``fully_shard``) wraps every Fp8BlockLinear
weight in :class:`Fp8AllGatherWeight`, a tensor subclass holding the high-precision shard.
FSDP2 calls its hooks around each all-gather:
- ``fsdp_pre_all_gather`` quantizes the local shard in the layer's weight blocks (32x32 or
  128x128, Hadamard-rotated if configured) and hands FSDP the fp8 bytes and fp32 scales; a
  shard of whole row blocks quantizes exactly as the full weight would, so gathering shards of
  bytes and scales along dim 0 yields the full quantized weight;
- ``fsdp_post_all_gather`` wraps the gathered bytes and scales as
  :class:`gem_kernels.fp8.Fp8BlockWeight`, which the layer consumes without requantizing.
So neither the wire (1 byte per weight + 4 bytes per block) nor the gathered weight is bf16.
Optimizer and gradients stay on the high-precision shard.

Requirement: every rank's shard holds whole row blocks (out_features / world_size a multiple
of the block); layers that don't are left on the ordinary all-gather.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from gem_kernels.fp8 import Fp8BlockLinear, Fp8BlockWeight, hadamard_for, quantize_weight
from gem_kernels.fp8.reference import BlockFp8

_aten = torch.ops.aten
# ops whose result is still "the weight" (sharding, padding, copies): keep the subclass
_PRESERVE = {
    _aten.empty_like.default, _aten.new_zeros.default, _aten.new_empty.default,
    _aten.slice.Tensor, _aten.copy_.default, _aten.view.default, _aten.as_strided.default,
    _aten._to_copy.default, _aten._pin_memory.default, _aten.split.Tensor,
    _aten.clone.default, _aten.detach.default, _aten.alias.default,
}


class Fp8AllGatherWeight(torch.Tensor):
    """High-precision weight shard whose FSDP2 all-gather travels as block-scaled FP8."""

    _tensor: torch.Tensor
    # dtypes of the last all-gather inputs handed to FSDP (the bytes on the wire), for checks
    last_all_gather_dtypes: tuple[torch.dtype, ...] = ()

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t._tensor
        args, kwargs = tree_map_only(Fp8AllGatherWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return tree_map_only(torch.Tensor, Fp8AllGatherWeight, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner_tensors["_tensor"])

    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any
                            ) -> tuple[tuple[torch.Tensor, ...], Any]:
        if not isinstance(module, Fp8BlockLinear):
            raise TypeError(f"FP8 all-gather weight on a {type(module).__name__}")
        cfg = module.cfg
        rows = self._tensor.shape[0]
        if rows % cfg.weight_block[0]:
            raise ValueError(f"shard of {rows} rows is not whole {cfg.weight_block} blocks")
        q = quantize_weight(self._tensor, cfg, kernel=module.kernel)
        inputs = (q.data.contiguous(), q.scale.contiguous())
        Fp8AllGatherWeight.last_all_gather_dtypes = tuple(t.dtype for t in inputs)
        return inputs, (cfg.weight_block, hadamard_for(cfg, self._tensor.device))

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
        data, scale = all_gather_outputs
        block, hadamard = metadata
        if out is not None:  # FSDP refilled the same buffers in place: nothing to rebuild
            if not isinstance(out, Fp8BlockWeight) or \
                    out.fp8.data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
                raise AssertionError("gathered FP8 weight does not alias FSDP's buffers")
            return
        weight = Fp8BlockWeight(BlockFp8(data, scale, block), param_dtype, hadamard)
        return weight, (data, scale)


def enable_fp8_all_gather(model: nn.Module, world_size: int) -> list[str]:
    """Wrap the weights of Fp8BlockLinear layers whose shards hold whole row blocks.

    Call before ``fully_shard``. Returns the names of the layers that gather in FP8.
    """
    names = []
    for name, mod in model.named_modules():
        if not isinstance(mod, Fp8BlockLinear) or isinstance(mod.weight, Fp8AllGatherWeight):
            continue
        rows = mod.weight.shape[0]
        if rows % world_size or (rows // world_size) % mod.cfg.weight_block[0]:
            continue
        w = mod.weight
        mod.weight = nn.Parameter(Fp8AllGatherWeight(w.data), requires_grad=w.requires_grad)
        names.append(name)
    return names
