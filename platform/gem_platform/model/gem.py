"""GemModel: the GEM-style ranking network, wired from a ModelConfig and the dataset's meta.

Data flow per batch (B samples, T history tokens in total, nothing padded):
  items (+ their categories, TorchRec EmbeddingCollection) + action + age -> history tokens
  (T, d), each with its affinity to the candidate (DIN-style)
  sparse features (TorchRec EmbeddingBagCollection) + dense + ad -> context tokens (B, C, d)
  sequence tower: self-attention over each history (full | sliding | block64 | padded),
  queries and keys from each token or from its category row alone (model.attention_qk), through
  two projections or one shared one (model.shared_qk)
  cross attention: history tokens (long Q) x own context tokens (short KV), GDPA
  pooled attention: nq queries per sample (short Q) x history tokens (long KV), GDPA
  short-term tokens: the newest event's token, the mean of the newest N
  (model.newest_token, recent_mean), the last layer's attention read for the newest event
  (model.newest_attention)
  DHEN: expert ensemble over [pooled, short-term, context] tokens -> CTR and CVR logits
  wide terms (model.wide): a learned weight per task for each sparse id, the candidate's item
  and category, each dense feature and each product of two, added to those logits
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)

from gem_platform import model_variants
from gem_platform.data.batch import TASKS, JaggedBatch
from gem_platform.data.meta import DatasetMeta
from gem_platform.model.attention import SelfAttentionSpec
from gem_platform.model.interaction import CrossAttention, DhenLayer, PooledAttention
from gem_platform.model.sequence import SequenceTower
from gem_platform.model.small_table import OneHotEmbedding
from gem_platform.model.wide import WideDense, wide_features, wide_logits, wide_tables
from gem_platform.recipe import ModelConfig

ITEM_FEATURES = ("hist_item", "ad_item")
CATEGORY_FEATURES = ("hist_category", "ad_category")
# seq_age is log1p(seconds): ~11.4 for a day-old event (log1p(86400)), ~17.3 for a year-old
# one. Divided by log1p(one year) it stays in [0, ~1], so age does not drown the item signal in
# every history token.
AGE_SCALE = 17.3
# Position from the end of the history: one bucket per position for the last EXACT_RECENCY
# events, then one per doubling; recency is what tells recent from long-term interests.
EXACT_RECENCY = 16
RECENCY_BUCKETS = EXACT_RECENCY + 8


def recency_buckets(offsets: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """(T,) bucket of each history event's position counted from its sample's newest event."""
    from_end = offsets[owner + 1] - 1 - torch.arange(owner.numel(), device=owner.device)
    far = EXACT_RECENCY + torch.log2(from_end.clamp_min(EXACT_RECENCY) / EXACT_RECENCY).long()
    return torch.where(from_end < EXACT_RECENCY, from_end, far).clamp_max(RECENCY_BUCKETS - 1)


def newest_mean(x: torch.Tensor, offsets: torch.Tensor, newest: int) -> torch.Tensor:
    """(B, d) fp32 mean of each sample's ``newest`` last history tokens (all of them in a
    shorter history); zeros for an empty history. Gathers B x newest rows, not all T."""
    b = offsets.numel() - 1
    if x.shape[0] == 0:
        return x.new_zeros(b, x.shape[1], dtype=torch.float32)
    back = torch.arange(newest, device=x.device)
    lengths = offsets[1:] - offsets[:-1]
    kept = (back[None, :] < lengths[:, None]).to(torch.float32)  # (B, newest)
    rows = x[(offsets[1:, None] - 1 - back[None, :]).clamp_min(0)].float()  # (B, newest, d)
    return (rows * kept[..., None]).sum(1) / lengths.clamp(1, newest)[:, None]


def unit_norm_init(dim: int) -> dict[str, float]:
    """Uniform init whose rows have norm ~1 (TorchRec's default scales rows by 1/sqrt(rows),
    which for large tables starts item signals orders of magnitude below the other inputs)."""
    bound = (3.0 / dim) ** 0.5
    return {"weight_init_min": -bound, "weight_init_max": bound}


def item_tables(meta: DatasetMeta, d: int) -> list[EmbeddingConfig]:
    """The item table and, where items carry categories, the category table. They share one
    collection: the category (a small vocabulary, seen in every batch) carries what an item
    has in common with its kind, so history-candidate affinity is learnable long before each
    item's own row is."""
    tables = [EmbeddingConfig(name="item", embedding_dim=d, num_embeddings=meta.num_items + 1,
                              feature_names=list(ITEM_FEATURES), **unit_norm_init(d))]
    if meta.num_categories > 0:
        tables.append(EmbeddingConfig(name="category", embedding_dim=d,
                                      num_embeddings=meta.num_categories,
                                      feature_names=list(CATEGORY_FEATURES),
                                      **unit_norm_init(d)))
    return tables


def sparse_tables(meta: DatasetMeta, dim: int) -> list[EmbeddingBagConfig]:
    """One pooled table per sparse feature: mean over a multi-hot feature's ids, else sum."""
    return [EmbeddingBagConfig(name=f"t_{f.name}", embedding_dim=dim,
                               num_embeddings=f.vocab_size, feature_names=[f.name],
                               pooling=PoolingType.MEAN if f.multi_hot else PoolingType.SUM,
                               **unit_norm_init(dim))
            for f in meta.sparse_features]


class GemModel(nn.Module):
    def __init__(self, cfg: ModelConfig, meta: DatasetMeta,
                 planted_items: torch.Tensor | None = None) -> None:
        """``planted_items`` (num_items+1, k <= d_model): with model.item_vectors=planted, the
        fixed vectors that stand for items instead of the tables' rows (zero-padded to d)."""
        super().__init__()
        d = cfg.d_model
        self.cfg, self.meta = cfg, meta
        if (cfg.item_vectors == "planted") != (planted_items is not None):
            raise ValueError("model.item_vectors=planted needs the planted item vectors "
                             "(and only it takes them)")
        self.planted_items: torch.Tensor | None
        if planted_items is not None:
            planted = nn.functional.pad(planted_items.float(), (0, d - planted_items.shape[1]))
            self.register_buffer("planted_items", planted, persistent=False)
        else:
            self.planted_items = None
        self.use_categories = meta.num_categories > 0
        # Tables go on the default device: the CPU (moved with the model), or "meta" under
        # `with torch.device("meta")` where only sizes are wanted (planning_model).
        self.item_embeddings = EmbeddingCollection(tables=item_tables(meta, d),
                                                   device=torch.get_default_device())
        self.sparse_embeddings = EmbeddingBagCollection(
            tables=sparse_tables(meta, cfg.sparse_dim), device=torch.get_default_device())
        self.sparse_names = [f.name for f in meta.sparse_features]
        self.action_embedding = OneHotEmbedding(meta.num_action_types + 1, d)
        nn.init.normal_(self.action_embedding.weight, std=d**-0.5)
        self.recency_embedding = OneHotEmbedding(RECENCY_BUCKETS, d)
        nn.init.normal_(self.recency_embedding.weight, std=d**-0.5)
        self.age_proj = nn.Linear(1, d)
        # Target-aware history tokens (as in DIN): item x candidate, elementwise, so the
        # candidate's affinity to each past event is one projection away from every layer.
        self.affinity_proj = nn.Linear(d, d)
        # Elements of a product of two unit-norm rows are ~1/d; scaled by sqrt(d) they start
        # as large as the other token inputs instead of ~sqrt(d) times smaller.
        self.affinity_scale = d**0.5
        self.sparse_proj = nn.Linear(cfg.sparse_dim, d)
        self.dense_proj = nn.Linear(max(meta.dense_dim, 1), d)
        if cfg.kernel not in model_variants.KERNELS:
            model_variants.get(cfg.kernel)  # loaded here, not first inside a compiled region
        spec = SelfAttentionSpec(
            kind=cfg.attention, window=cfg.window, causal=cfg.causal,
            rope_base=10000.0 if cfg.rope else None, kernel=cfg.kernel,
        )
        if cfg.attention_qk == "category" and not self.use_categories:
            raise ValueError("model.attention_qk=category needs a dataset whose items carry "
                             "categories (meta.num_categories > 0); set it to token")
        self.sequence = SequenceTower(d, cfg.num_heads, cfg.seq_layers, spec, cfg.qk_norm,
                                      expose_attention=cfg.newest_attention,
                                      side_qk=cfg.attention_qk == "category",
                                      shared_qk=cfg.shared_qk)
        self.cross = CrossAttention(d, cfg.num_heads, cfg.gdpa_activation, cfg.kernel)
        self.pooled = PooledAttention(d, cfg.num_heads, cfg.pooled_queries, cfg.gdpa_activation,
                                      cfg.kernel, mean_base=cfg.pooled_base == "mean")
        self.num_context = 2 + len(self.sparse_names)  # ad, dense, one per sparse feature
        num_tokens = self.num_dhen_tokens
        self.dhen = nn.ModuleList(
            DhenLayer(num_tokens, d, cfg.num_experts, cfg.expert_hidden)
            for _ in range(cfg.dhen_layers)
        )
        self.head = nn.Sequential(
            nn.LayerNorm(num_tokens * d), nn.Linear(num_tokens * d, cfg.head_hidden), nn.SiLU(),
            nn.Linear(cfg.head_hidden, len(TASKS)),
        )
        self.wide_embeddings: EmbeddingBagCollection | None = None
        self.wide_dense: WideDense | None = None
        if cfg.wide:
            self.wide_embeddings = EmbeddingBagCollection(tables=wide_tables(meta),
                                                          device=torch.get_default_device())
            self.wide_dense = WideDense(meta.dense_dim)
            scale = torch.tensor([getattr(cfg.wide_scale, task) for task in TASKS])
            self.register_buffer("wide_scale", scale, persistent=False)

    @property
    def newest_windows(self) -> tuple[int, ...]:
        """Short-term DHEN tokens, each the mean of this many newest history tokens: 1 for the
        newest event's token (model.newest_token), N for model.recent_mean."""
        windows = (1,) if self.cfg.newest_token else ()
        return windows + ((self.cfg.recent_mean,) if self.cfg.recent_mean else ())

    @property
    def num_dhen_tokens(self) -> int:
        """Tokens per sample into DHEN: pooled queries, the short-term ones (and the newest
        event's attention read, model.newest_attention), context."""
        return (self.cfg.pooled_queries + len(self.newest_windows)
                + int(self.cfg.newest_attention) + self.num_context)

    def embedding_parameters(self) -> list[nn.Parameter]:
        """Sparse (embedding-table) parameters: trained by the sparse optimizer."""
        wide = self.wide_embeddings.parameters() if self.wide_embeddings is not None else ()
        return [*self.item_embeddings.parameters(), *self.sparse_embeddings.parameters(), *wide]

    def sparse_inputs(self, batch: JaggedBatch) -> dict[str, KeyedJaggedTensor]:
        """What each embedding collection receives for ``batch``, by attribute name (a
        pipeline starts their input distribution a step ahead from it)."""
        inputs = {"item_embeddings": self._item_features(batch),
                  "sparse_embeddings": batch.sparse}
        if self.wide_embeddings is not None:
            inputs["wide_embeddings"] = wide_features(batch, self.use_categories)
        return inputs

    def _item_features(self, batch: JaggedBatch) -> KeyedJaggedTensor:
        """History and candidate items (and their categories) as one KeyedJaggedTensor."""
        keys, values = list(ITEM_FEATURES), [batch.seq_item_ids, batch.ad_item_id]
        if self.use_categories:
            if batch.seq_item_categories is None or batch.ad_category is None:
                raise ValueError(
                    "the model was built for a dataset whose items carry categories "
                    "(meta.num_categories > 0), but the batch holds none; load batches from "
                    "that dataset (SampleTable.collate)"
                )
            keys += CATEGORY_FEATURES
            values += [batch.seq_item_categories, batch.ad_category]
        samples = batch.num_samples
        one = torch.ones(samples, dtype=torch.int64, device=batch.ad_item_id.device)
        per_key = [batch.seq_lengths.to(torch.int64), one]
        pairs = len(keys) // 2
        # Each key's total length is known on the host (T events, one ad per sample): given,
        # TorchRec need not read the lengths back from the device (a sync every step).
        return KeyedJaggedTensor(
            keys=keys, values=torch.cat(values), lengths=torch.cat(per_key * pairs),
            stride=samples, length_per_key=[batch.num_tokens, samples] * pairs)

    def _item_lookup(self, batch: JaggedBatch
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(T, d) history and (B, d) candidate item embeddings (item + category rows), and the
        history's (T, d) category rows alone (None without categories)."""
        if self.planted_items is not None:
            return (self.planted_items[batch.seq_item_ids],
                    self.planted_items[batch.ad_item_id], None)
        out = self.item_embeddings(self._item_features(batch))
        hist, ad = out["hist_item"].values(), out["ad_item"].values()
        if not self.use_categories:
            return hist, ad, None
        categories = out["hist_category"].values()
        return hist + categories, ad + out["ad_category"].values(), categories

    def forward(self, batch: JaggedBatch) -> torch.Tensor:
        """(B, 2) logits: CTR and CVR."""
        offsets, max_len = batch.seq_offsets, batch.max_seq_len
        hist, ad, categories = self._item_lookup(batch)
        owner = torch.repeat_interleave(torch.arange(ad.shape[0], device=ad.device),
                                        batch.seq_lengths, output_size=hist.shape[0])
        x = (hist + self.action_embedding(batch.seq_action_types)
             + self.recency_embedding(recency_buckets(offsets, owner))
             + self.age_proj(batch.seq_age.unsqueeze(-1) / AGE_SCALE)
             + self.affinity_proj(hist * ad[owner] * self.affinity_scale))
        sparse = self.sparse_embeddings(batch.sparse).to_dict()
        feature_tokens = [self.sparse_proj(sparse[name]) for name in self.sparse_names]
        dense = batch.dense if batch.dense.shape[1] else batch.dense.new_zeros(ad.shape[0], 1)
        context = torch.stack([ad, self.dense_proj(dense), *feature_tokens], dim=1)

        side = categories if self.cfg.attention_qk == "category" else None
        x, read = self.sequence.forward_with_attention(x, offsets, max_len, side)
        x = self.cross(x, offsets, max_len, context)
        pooled = self.pooled(x, offsets, max_len, ad)

        parts = [pooled]
        for newest in self.newest_windows:
            parts.append(newest_mean(x, offsets, newest)[:, None].to(x.dtype))
        if read is not None:  # model.newest_attention
            parts.append(newest_mean(read, offsets, 1)[:, None].to(x.dtype))
        tokens = torch.cat([*parts, context], dim=1)
        for layer in self.dhen:
            tokens = layer(tokens)
        logits = self.head(tokens.flatten(1))
        if self.wide_embeddings is None or self.wide_dense is None:
            return logits
        pooled = self.wide_embeddings(wide_features(batch, self.use_categories))
        return logits + wide_logits(pooled, self.wide_dense(dense), self.wide_scale)
