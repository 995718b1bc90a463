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
    ``nn.Embedding``'s CUDA backward sorts the indices and sums each row's run of them, a worst
    case for a table of a few rows looked up ~100k times (a few long runs); on the H200 the
    deterministic step of recipes/h200.yaml ran two such segment sums (``sum_and_scatter``,
    1.6 ms each) that its plain step did not. The one-hot matrix costs ``indices x rows``
    elements, so this is for tables of tens of rows, not for item tables."""

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(self.num_embeddings, device=indices.device)
        # a comparison, not F.one_hot: no scatter, and no bounds check read back to the host
        one_hot = (indices.unsqueeze(-1) == rows).to(self.weight.dtype)
        with torch.autocast(indices.device.type, enabled=False):
            return one_hot @ self.weight
