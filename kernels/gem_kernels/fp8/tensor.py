"""A weight that is already block-scaled FP8 (for example the output of an FP8 all-gather).

``Fp8BlockLinear`` consumes its bytes and scales directly, so a gathered weight is never
materialized in bf16 on the matmul path. Any other op on it falls back to the dequantized
tensor (correct, not fast), so generic code that touches the weight keeps working.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from gem_kernels.fp8.reference import BlockFp8, apply_hadamard, dequantize_reference

_aten = torch.ops.aten
_SAME_VIEW = {_aten.detach.default, _aten.alias.default, _aten.view.default,
              _aten.as_strided.default, _aten._unsafe_view.default}


class Fp8BlockWeight(torch.Tensor):
    """Wrapper tensor (reports the high-precision dtype) holding a ``BlockFp8`` weight.

    ``hadamard``: the normalized Q the weight was rotated with before quantizing (or None);
    dequantizing undoes it.
    """

    _fp8: BlockFp8
    _hadamard: torch.Tensor | None

    @staticmethod
    def __new__(cls, fp8: BlockFp8, dtype: torch.dtype, hadamard: torch.Tensor | None = None,
                requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, fp8.data.shape, dtype=dtype, device=fp8.data.device,
            requires_grad=requires_grad)

    def __init__(self, fp8: BlockFp8, dtype: torch.dtype, hadamard: torch.Tensor | None = None,
                 requires_grad: bool = False):
        self._fp8 = fp8
        self._hadamard = hadamard

    @property
    def fp8(self) -> BlockFp8:
        return self._fp8

    @property
    def hadamard(self) -> torch.Tensor | None:
        return self._hadamard

    def dequantize(self) -> torch.Tensor:
        w = dequantize_reference(self._fp8, torch.float32)
        if self._hadamard is not None:
            w = apply_hadamard(w, self._hadamard.float().t())
        return w.to(self.dtype)

    def __repr__(self) -> str:  # never dequantize just to print
        return (f"Fp8BlockWeight(shape={tuple(self.shape)}, block={self._fp8.block}, "
                f"dtype={self.dtype})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args else None
        if func in _SAME_VIEW and isinstance(src, Fp8BlockWeight):
            size = args[1] if len(args) > 1 and func is not _aten.detach.default else src.shape
            if func in (_aten.detach.default, _aten.alias.default) or \
                    tuple(size) == tuple(src.shape):
                return Fp8BlockWeight(src._fp8, src.dtype, src._hadamard)
        unwrap = lambda t: t.dequantize() if isinstance(t, Fp8BlockWeight) else t
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
