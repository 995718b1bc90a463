"""Activation compression (``train.saved_activations``): the 16-bit activations autograd keeps
for the backward are stored in 8 bits and widened back when the backward reads them.

``bf16`` keeps every saved tensor as computed. ``fp8`` stores a saved tensor as
float8_e4m3fn, with one fp32 scale per ``BLOCK`` consecutive elements of its memory order
(the block's largest magnitude over 448: a block's largest value comes back exact, zeros stay
zeros, a block of zeros gets scale 1), when, and only when, all of these hold:

- it is a plain ``torch.Tensor`` (not a Parameter, not a subclass such as DTensor) of dtype
  bfloat16 or float16, with at least ``MIN_ELEMENTS`` elements;
- its elements do not overlap (a broadcast/expanded view would be materialized) and it spans
  at most ``MAX_SPAN`` times its elements of memory (it comes back with its strides, in a
  buffer of that span);
- its shape is not that of one of the model's parameters or its transpose: such a tensor is
  taken for a weight (autocast's bf16 copy, which a compiled region's saved tensors carry no
  history to tell apart), not an activation. An activation that happens to have a weight's
  shape is kept as computed.

Everything else is kept exactly as computed: fp32 tensors (the backward's statistics live
there: the attention log-sum-exp, LayerNorm mean and rstd, the FP8 layers' scales, and the
ops autocast runs in fp32), integer and bool tensors (offsets, indices, masks), 8-bit tensors,
small tensors. Under ``precision.mode: fp32`` no activation is 16-bit, so ``fp8`` would change
nothing and is refused.

After scaling each element is rounded to e4m3's 3 mantissa bits: an error of at most 2^-4 of
the element, or of 2^-10 of the block's scale below e4m3's normal range. A tensor saved by
several ops (the same object, unchanged) is stored once. The hooks are
``torch.autograd.graph.saved_tensors_hooks``, so they see:

- eager regions: every tensor an op saves, when the op saves it;
- compiled regions (torch.compile, AOTAutograd): the tensors the compiled forward keeps for its
  backward, all at once when the region's forward returns (within the region's forward they
  are 16-bit), given back with the sizes and strides the compiled backward expects;
- recomputed regions (non-reentrant torch.utils.checkpoint): nothing inside the region (the
  checkpoint's own hooks keep no activation, and it holds the region's input as is); what it
  recomputes in the backward is not compressed either.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gem_kernels.fp8.blockwise import dequantize_blocks, quantize_blocks
from gem_platform.recipe import Recipe

MIN_ELEMENTS = 4096  # smaller saved tensors stay as computed (scales and hooks would cost more)
BLOCK = 128  # consecutive elements (in memory order) sharing one fp32 scale
MAX_SPAN = 4  # a strided view spanning more memory than this many times its size stays as is
COMPRESSED = (torch.bfloat16, torch.float16)

Shape = tuple[int, ...]


class Fp8Tensor:
    """A tensor stored as float8_e4m3fn blocks with fp32 scales, in its memory order;
    ``dequantize`` returns it in its original dtype, shape and strides."""

    __slots__ = ("data", "scale", "shape", "stride", "order", "dtype", "numel", "__weakref__")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, like: torch.Tensor,
                 order: list[int]) -> None:
        self.data, self.scale, self.order = data, scale, order
        self.shape, self.stride, self.dtype, self.numel = (like.shape, like.stride(), like.dtype,
                                                           like.numel())

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def dequantize(self) -> torch.Tensor:
        """One pass on CUDA: the kernel writes straight into the result's storage when its
        memory order is dense (a strided result with gaps takes one 16-bit copy)."""
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype,
                                  device=self.data.device)
        in_memory_order = out.permute(self.order)
        if in_memory_order.is_contiguous():
            dequantize_blocks(self.data, self.scale, self.numel, self.dtype,
                              out=in_memory_order.view(-1))
        else:
            wide = dequantize_blocks(self.data, self.scale, self.numel, self.dtype)
            in_memory_order.copy_(wide.view(in_memory_order.shape))
        return out


def _memory_order(t: torch.Tensor) -> list[int]:
    """``t``'s dims from the outermost to the innermost in memory."""
    return sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d]), reverse=True)


def _span(t: torch.Tensor) -> int | None:
    """Elements of memory ``t`` spans (its numel when dense), or None when its elements may
    overlap (a broadcast/expanded view)."""
    span = 1
    for d in sorted((d for d in range(t.dim()) if t.shape[d] > 1), key=t.stride):
        if t.stride(d) < span:
            return None
        span += (t.shape[d] - 1) * t.stride(d)
    return span


@torch.no_grad()
def quantize(t: torch.Tensor) -> Fp8Tensor:
    """``t`` (floating, elements not overlapping) as float8_e4m3fn with one fp32 scale per
    ``BLOCK`` consecutive elements of its memory order."""
    order = _memory_order(t)
    flat = t.detach().permute(order).reshape(-1)  # a view when t is dense
    data, scale = quantize_blocks(flat, BLOCK)  # one Triton pass on CUDA
    return Fp8Tensor(data, scale, t, order)


def weight_shapes(params: Iterable[torch.Tensor]) -> frozenset[Shape]:
    """The shapes a weight takes in a saved tensor: each parameter's, reversed, and with its
    last two dims swapped."""
    shapes: set[Shape] = set()
    for p in params:
        s = tuple(p.shape)
        shapes.update((s, s[::-1], s[:-2] + s[-1:] + s[-2:-1]))
    return frozenset(shapes)


_WEIGHT_SHAPES: weakref.WeakKeyDictionary[nn.Module, frozenset[Shape]] = \
    weakref.WeakKeyDictionary()


def model_weight_shapes(model: nn.Module) -> frozenset[Shape]:
    """``weight_shapes`` of ``model``'s parameters, worked out once per model (the training
    step enters the hooks every step)."""
    shapes = _WEIGHT_SHAPES.get(model)
    if shapes is None:
        shapes = _WEIGHT_SHAPES[model] = weight_shapes(model.parameters())
    return shapes


def compressible(t: torch.Tensor, weights: frozenset[Shape] = frozenset()) -> bool:
    """The rule of the module docstring: whether ``fp8`` stores ``t`` in 8 bits (``weights``:
    the model's ``weight_shapes``)."""
    if not (type(t) is torch.Tensor and t.dtype in COMPRESSED and t.layout == torch.strided
            and t.numel() >= MIN_ELEMENTS and tuple(t.shape) not in weights):
        return False
    span = _span(t)
    return span is not None and span <= MAX_SPAN * t.numel()


class Fp8SavedTensors(contextlib.AbstractContextManager):
    """Saved-tensor hooks that store what ``compressible`` allows as ``Fp8Tensor`` and pass
    everything else through; ``model``'s parameters give the weight shapes kept as computed.
    A tensor saved again while it is alive and unchanged (same object, same version) shares
    its first copy. Counts what it stored in 8 bits: ``tensors``, ``original_bytes`` and
    ``stored_bytes``."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.weights = model_weight_shapes(model) if model is not None else frozenset()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        # id(tensor) -> (tensor, its version, its copy), all weak: no lifetime is extended
        self._copies: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
        self.tensors = self.original_bytes = self.stored_bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor | Fp8Tensor:
        if not compressible(t, self.weights):
            return t
        known = self._copies.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
            copy = known[2]()
            if copy is not None:
                return copy
        copy = quantize(t)
        self._copies[id(t)] = (weakref.ref(t), t._version, weakref.ref(copy))
        self.tensors += 1
        self.original_bytes += t.numel() * t.element_size()
        self.stored_bytes += copy.nbytes
        return copy

    @staticmethod
    def unpack(saved: torch.Tensor | Fp8Tensor) -> torch.Tensor:
        return saved.dequantize() if isinstance(saved, Fp8Tensor) else saved

    def __enter__(self) -> Fp8SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._copies.clear()
        self._hooks.__exit__(*exc)


def stored_bytes(t: torch.Tensor, weights: frozenset[Shape] = frozenset()) -> int:
    """What keeping ``t`` for the backward costs under ``fp8``: its 8-bit blocks and their
    scales where ``compressible``, else its storage (the activation-budget planner's count)."""
    if compressible(t, weights):
        return t.numel() + 4 * -(-t.numel() // BLOCK)
    return t.untyped_storage().nbytes()


@contextlib.contextmanager
def saved_activations(recipe: Recipe, model: nn.Module) -> Iterator[Fp8SavedTensors | None]:
    """The training forward's context for ``train.saved_activations``: fp8's hooks (weights
    told by ``model``'s parameter shapes), or nothing for bf16. (The recipe refuses fp8 under
    precision.mode=fp32, where nothing would be compressed.)"""
    if recipe.train.saved_activations == "bf16":
        yield None
        return
    with Fp8SavedTensors(model) as hooks:
        yield hooks


__all__ = ["BLOCK", "MAX_SPAN", "MIN_ELEMENTS", "Fp8SavedTensors", "Fp8Tensor",
           "compressible", "model_weight_shapes", "quantize", "saved_activations",
           "stored_bytes", "weight_shapes"]
