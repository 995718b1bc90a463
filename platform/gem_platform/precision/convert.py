"""Model conversion to block-scaled FP8: swap nn.Linear for Fp8BlockLinear, except the layers
that stay in bf16: the last ``keep_last`` layers that would otherwise run in FP8 (the ones
feeding the sensitive CTR/CVR logits), any layer whose name matches a ``keep`` pattern, any
layer too narrow to gain (``min_features``), and any layer whose shape the configuration cannot
run."""

from __future__ import annotations

import fnmatch
import logging

from torch import nn

from gem_kernels.fp8 import Fp8BlockLinear, Fp8Config

log = logging.getLogger(__name__)


def _matches(name: str, patterns: list[str]) -> bool:
    """fnmatch on the qualified name, or an exact match of its trailing components."""
    return any(fnmatch.fnmatchcase(name, p) or name == p or name.endswith("." + p)
               for p in patterns)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def convert_to_fp8(model: nn.Module, *, block: int = 128, hadamard: bool = False,
                   hadamard_block: int = 128, stochastic_rounding: bool = False,
                   wgrad: str = "bf16", keep_last: int = 1, keep: list[str] | None = None,
                   seed: int = 0, min_features: int = 0) -> list[str]:
    """Convert ``model``'s linear layers in place; returns the converted module names.

    Layers are ordered as ``named_modules`` visits them (definition order). ``keep_last``
    counts only layers that would otherwise be converted: a final projection too narrow for
    FP8 (a 2-logit output) stays bf16 by shape, so counting it would leave the layer before it
    (the head's hidden layer, the largest single source of logit error) in FP8 and make
    ``keep_last=1`` do nothing. A layer whose shape the configuration cannot run (in_features
    not a multiple of the block or of the Hadamard block) stays bf16 and is logged, as does one
    whose narrower side (min of in and out features) is below ``min_features``: a narrow
    layer's GEMM is too short for FP8 to repay its quantization and launches. Parameters are
    shared, not copied, so an optimizer built before the conversion keeps working.
    """
    cfg = Fp8Config(block=block, hadamard=hadamard, hadamard_block=hadamard_block,
                    stochastic_rounding=stochastic_rounding, wgrad=wgrad, seed=seed)
    keep = list(keep or [])
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    candidates = []
    for name, lin in model.named_modules():
        if not isinstance(lin, nn.Linear) or isinstance(lin, Fp8BlockLinear):
            continue
        if _matches(name, keep):
            continue
        if min(lin.in_features, lin.out_features) < min_features:
            log.info("fp8: %s (%d -> %d) stays bf16: narrower than min_features=%d",
                     name, lin.in_features, lin.out_features, min_features)
            continue
        if not cfg.supports(lin.in_features, lin.out_features):
            log.info("fp8: %s (%d -> %d) stays bf16: shape not supported by %s",
                     name, lin.in_features, lin.out_features, cfg)
            continue
        candidates.append((name, lin))
    if keep_last:
        for name, _ in candidates[-keep_last:]:
            log.info("fp8: %s stays bf16 (one of the last %d FP8-capable layers)",
                     name, keep_last)
        candidates = candidates[:-keep_last]
    for name, lin in candidates:
        _set_submodule(model, name, Fp8BlockLinear.from_linear(lin, cfg))
    return [name for name, _ in candidates]
