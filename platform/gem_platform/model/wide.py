"""The wide terms of the logits, as in Wide & Deep: per task, a learned weight for each sparse
feature's id, for the candidate's item and category, for each dense feature and each product
of two, added to what the deep network predicts.

Why: an effect that belongs to one id (a user's or an ad's own click rate) reaches the deep
network's logit only through that id's row, its projection, the expert layers and the head,
and within one pass over the data it is learned there slowly and noisily. A weight per id and
task learns it the way a logistic regression on one-hot ids does. The weights start at zero,
so the model starts as the deep network alone. The products of dense features are Wide &
Deep's cross-product features: an interaction the deep network would otherwise build from one
linear projection of the dense features.

The tables are TorchRec tables like the others (sharded, fused and trained by the table
optimizer at ``train.sparse_lr``); each task's weights are read at a scale of their own
(``model.wide_scale``): under Adagrad a step moves a weight's logit about ``scale**2`` times
as far as at scale 1, as if their learning rate were that much lower, on every path the tables
take (replicated, fused, sharded).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
)

from gem_platform.data.batch import TASKS, JaggedBatch
from gem_platform.data.meta import DatasetMeta

# Columns of a wide table: one per task, rounded up to FBGEMM's multiple of 4 (the extra
# columns are never read, so they get no gradient and stay zero).
WIDE_DIM = -(-len(TASKS) // 4) * 4
# Dense features whose pairwise products get a wide weight each; beyond, the dense term stays
# linear (the pairs grow as the square).
MAX_PAIRED_DENSE = 32
# The candidate's own features in the wide tables (their names in its input, kept apart from
# the item collection's feature names).
WIDE_AD_ITEM, WIDE_AD_CATEGORY = "wide_ad_item", "wide_ad_category"


def _zero_table(name: str, rows: int, features: list[str], pooling: PoolingType
                ) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name=name, embedding_dim=WIDE_DIM, num_embeddings=rows,
                              feature_names=features, pooling=pooling,
                              weight_init_min=0.0, weight_init_max=0.0)


def wide_tables(meta: DatasetMeta) -> list[EmbeddingBagConfig]:
    """One table per sparse feature (the mean of a multi-hot feature's weights, as its deep
    table pools), the candidate item's and, where items carry them, its category's; one
    column per task (``WIDE_DIM`` in all), all zero."""
    tables = [_zero_table(f"wide_{f.name}", f.vocab_size, [f.name],
                          PoolingType.MEAN if f.multi_hot else PoolingType.SUM)
              for f in meta.sparse_features]
    tables.append(_zero_table("wide_ad_item", meta.num_items + 1, [WIDE_AD_ITEM],
                              PoolingType.SUM))
    if meta.num_categories > 0:
        tables.append(_zero_table("wide_ad_category", meta.num_categories, [WIDE_AD_CATEGORY],
                                  PoolingType.SUM))
    return tables


def wide_features(batch: JaggedBatch, use_categories: bool) -> KeyedJaggedTensor:
    """The wide tables' input: the batch's sparse features, then the candidate's item (and
    category), one id per sample."""
    samples = batch.num_samples
    keys, values = [WIDE_AD_ITEM], [batch.ad_item_id]
    if use_categories:
        keys.append(WIDE_AD_CATEGORY)
        values.append(batch.ad_category)
    one = torch.ones(samples * len(keys), dtype=torch.int64, device=batch.ad_item_id.device)
    ad = KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=one, stride=samples,
                           length_per_key=[samples] * len(keys))
    return KeyedJaggedTensor.concat([batch.sparse, ad])


class WideDense(nn.Module):
    """The dense features' terms per task: one per feature and one per product of two (for up
    to ``MAX_PAIRED_DENSE`` features). Zero at the start."""

    def __init__(self, dense_dim: int) -> None:
        super().__init__()
        n = max(dense_dim, 1)
        pairs = torch.triu_indices(n, n, 1) if n <= MAX_PAIRED_DENSE else torch.zeros(2, 0)
        self.register_buffer("pairs", pairs.long(), persistent=False)
        self.linear = nn.Linear(n + pairs.shape[1], len(TASKS))
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        i, j = self.pairs
        return self.linear(torch.cat([dense, dense[:, i] * dense[:, j]], dim=1))


def wide_logits(pooled: KeyedTensor, dense_term: torch.Tensor, scale: torch.Tensor
                ) -> torch.Tensor:
    """(B, tasks): the tables' pooled weights summed over features, read at each task's
    ``scale`` (tasks,), plus the dense term."""
    weights = pooled.values().view(dense_term.shape[0], -1, WIDE_DIM)[..., :len(TASKS)]
    return (scale * weights.sum(1)).to(dense_term.dtype) + dense_term
