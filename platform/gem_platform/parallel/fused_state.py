"""Setting the state of TorchRec's fused table optimizer in place.

The fused optimizer (FBGEMM's TBE, Adagrad inside the backward) takes no starting accumulator
value; its state is exposed as ShardedTensors (or DTensors) viewing the kernel's own buffers,
so writing their local pieces changes what the next backward reads.
"""

from __future__ import annotations

import torch


def _local_pieces(value: object) -> list[torch.Tensor]:
    if hasattr(value, "local_shards"):  # ShardedTensor
        return [shard.tensor for shard in value.local_shards()]
    if hasattr(value, "to_local"):  # DTensor
        return [value.to_local()]
    return [value] if isinstance(value, torch.Tensor) else []


@torch.no_grad()
def fill_fused_state(optimizer: torch.optim.Optimizer, value: float) -> int:
    """Set every floating-point state tensor of ``optimizer`` (Adagrad's accumulators) on this
    rank to ``value``; returns how many local pieces were written."""
    written = 0
    for state in optimizer.state.values():
        for tensor in state.values():
            for piece in _local_pieces(tensor):
                if piece.is_floating_point():
                    piece.fill_(value)
                    written += 1
    if not written:
        raise RuntimeError("the fused table optimizer exposes no state to set")
    return written
