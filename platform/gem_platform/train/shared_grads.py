"""Give parameters whose ``.grad`` is one and the same memory their own copy.

A compiled backward may return one buffer as the gradient of several parameters whose
gradients are equal: Inductor computes the biases of a DHEN layer's experts and of its dot
interaction, which all feed one sum, as one reduction, and autograd stores that buffer as the
``.grad`` of each of them. Every in-place update after the backward then touches that memory
once per parameter: clipping's multi-tensor scale runs those updates concurrently in one
launch (a race: the result varies from run to run), a gradient all-reduce or accumulation
would add it several times. Copies make each gradient its own again.

Only exact duplicates (same address, shape and strides) count: distinct views of one flat
buffer (a data-parallel bucket) are left as they are. DTensor gradients come from FSDP's
reduce-scatter, one buffer each, and are not checked.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def separate_shared_grads(params: Iterable[nn.Parameter]) -> int:
    """Replace every ``.grad`` that repeats an earlier parameter's by a copy; returns how many
    were copied. Reads only tensor metadata on the host (no device sync): the address of each
    gradient, and shapes and strides only where two addresses coincide."""
    seen: dict[int, list[torch.Tensor]] = {}
    copied = 0
    for p in params:
        g = p.grad
        if g is None or isinstance(g, DTensor) or g.is_sparse:
            continue
        earlier = seen.get(g.data_ptr())
        if earlier is None:
            seen[g.data_ptr()] = [g]
        elif any(o.shape == g.shape and o.stride() == g.stride() for o in earlier):
            p.grad = g.clone()
            copied += 1
        else:
            earlier.append(g)
    return copied
