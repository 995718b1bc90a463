"""Cost models: how much compute a sample costs, so batches can be balanced on it.

Step time of a rank is proportional to the work of its batch, so the cost model must follow the
model's FLOPs. ``length`` fits towers dominated by per-token layers; ``attention`` adds the
quadratic term of full self-attention over the sequence. Per layer, attention costs 4*L^2*d
FLOPs (scores and values) and the projections plus a 4x FFN cost 24*L*d^2, so the work of a
sample is proportional to ``L^2 + 6*d*L``.
"""

from __future__ import annotations

import numpy as np

from gem_platform.balance.config import CostName

DEFAULT_MODEL_DIM = 128


def sample_work(
    seq_lengths: np.ndarray, cost: CostName = "length", model_dim: int = DEFAULT_MODEL_DIM
) -> np.ndarray:
    """Work of each sample (float64, same shape as ``seq_lengths``)."""
    lengths = np.asarray(seq_lengths, dtype=np.float64)
    if cost == "length":
        return lengths
    if cost == "attention":
        return lengths * (lengths + 6.0 * model_dim)
    raise ValueError(f"unknown cost model {cost!r}; expected 'length' or 'attention'")


def batch_work(
    seq_lengths: np.ndarray,
    indices: np.ndarray,
    cost: CostName = "length",
    model_dim: int = DEFAULT_MODEL_DIM,
) -> float:
    """Work of the batch made of samples ``indices`` (positions into ``seq_lengths``)."""
    picked = np.asarray(seq_lengths)[np.asarray(indices, dtype=np.int64)]
    return float(sample_work(picked, cost, model_dim).sum())
