"""GDPA (generalized dot-product attention): act(scale * Q K^T) V with no softmax on jagged Q
and jagged KV, for self, cross (long Q, short KV) and pooled (short Q, long KV) attention;
Triton forward and backward, PyTorch reference."""

from gem_kernels.gdpa.op import TUNER, gdpa
from gem_kernels.gdpa.reference import gdpa_reference


def tuning_seconds() -> float:
    """Wall seconds this process has spent choosing among GDPA's launch plans (cumulative)."""
    return TUNER.seconds


__all__ = ["gdpa", "gdpa_reference", "tuning_seconds"]
