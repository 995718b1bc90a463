"""Lookups into tables of a few rows (action types, recency buckets) as a one-hot product."""

from __future__ import annotations

import torch
from torch import nn


class OneHotEmbedding(nn.Embedding):
    """An ``nn.Embedding`` (same parameter, same checkpoints) for tables of a few rows, looked
    up as ``one_hot(indices) @ weight`` in the weight's dtype, outside autocast.

    Its rows come out exactly as a lookup gives them (one nonzero term per output; fp32 tables
    exactly where fp32 matmuls are not allowed TF32), and its weight gradient is one matmul,
    ``one_hot^T @ grad``, which sums each row's contributions in a fixed order in every mode.
    ``nn.Embedding``'s CUDA backward sorts the indices and sums each row's run of them: for a
    table of a few rows looked up once per history token, a few long runs, its slowest case
    (docs/bench: the deterministic step of recipes/h200.yaml). The one-hot matrix costs
    ``indices x rows`` elements, so this is for tables of tens of rows, not for item tables.
    Indices are not bounds-checked (that would read them back to the host, or add a device
    assert, every call): one outside ``[0, rows)`` looks up a zero row. The model's indices are
    in range by construction (recency buckets are clamped) or by the data readers' validation
    (action types, gem_platform.data.validate)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        # no padding_idx, max_norm or sparse gradients: the product implements none of them
        super().__init__(num_embeddings, embedding_dim)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(self.num_embeddings, device=indices.device)
        # a comparison, not F.one_hot: no scatter, and no bounds check read back to the host
        one_hot = (indices.unsqueeze(-1) == rows).to(self.weight.dtype)
        with torch.autocast(indices.device.type, enabled=False):
            return one_hot @ self.weight
