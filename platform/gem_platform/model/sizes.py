"""The sizes that communication volume depends on, read off a built model.

Used by `gemctl plan` to price every collective of a parallel configuration without running.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gem_platform.data.meta import META_FILE, DatasetMeta
from gem_platform.model.gem import GemModel
from gem_platform.model.interaction import MlpExpert
from gem_platform.recipe import Recipe
from gem_platform.topology.costs import ModelSizes

# Bytes of a gathered parameter by training precision (fp8 weights travel as 1 byte + scales).
PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp8_block": 1}


def planning_meta(recipe: Recipe) -> DatasetMeta:
    """The dataset's meta if it exists on disk, else what a synthetic config will produce."""
    if (Path(recipe.data.path) / META_FILE).exists() or recipe.data.source != "synthetic":
        return DatasetMeta.load(recipe.data.path)
    from gem_platform.data.synthetic import sparse_specs

    syn = recipe.data.synthetic
    return DatasetMeta(
        source="synthetic", num_items=syn.num_items, num_action_types=syn.num_action_types,
        sparse_features=sparse_specs(syn), dense_dim=syn.dense_dim, num_train=syn.num_train,
        num_eval=syn.num_eval, ctr_base_rate=syn.ctr_base_rate, cvr_base_rate=syn.cvr_base_rate,
        max_seq_len=syn.seq_len.max, num_categories=syn.num_clusters,
    )


def planning_model(recipe: Recipe) -> GemModel:
    """The recipe's model on the meta device: every size, no memory (a GEM-width model with a
    1M-row item table would take ~8 GB of host memory to plan otherwise)."""
    with torch.device("meta"):
        return GemModel(recipe.model, planning_meta(recipe))


def mean_history_length(recipe: Recipe) -> float:
    s = recipe.data.synthetic.seq_len
    return float(min(max(s.mean, s.min), s.max))


def model_sizes(model: GemModel, recipe: Recipe) -> ModelSizes:
    """Parameter and activation sizes of this model under this recipe's precision and batch."""
    cfg = model.cfg
    pbytes = PARAM_BYTES[recipe.precision.mode]
    act_bytes = 4 if recipe.precision.mode == "fp32" else 2
    embedding_ids = {id(p) for p in model.embedding_parameters()}
    experts = [m for m in model.modules() if isinstance(m, MlpExpert)]
    expert_ids = {id(p) for e in experts for p in e.parameters()}
    dense = sum(p.numel() for p in model.parameters()
                if id(p) not in embedding_ids and id(p) not in expert_ids)
    one_expert = sum(p.numel() for p in experts[0].parameters()) * cfg.dhen_layers \
        if experts else 0
    tables = tuple(p.numel() * pbytes for p in model.embedding_parameters())
    # Pooled sparse features plus the (sequence) item lookups of history and candidate ad.
    pooled = len(model.sparse_names) * cfg.sparse_dim * act_bytes
    items = (mean_history_length(recipe) + 1) * cfg.d_model * act_bytes
    dhen_tokens = model.num_dhen_tokens
    return ModelSizes(
        dense_params=dense,
        expert_params=one_expert,
        num_experts=cfg.num_experts if experts else 0,
        embedding_table_bytes=tables,
        pooled_embedding_bytes_per_sample=int(pooled + items),
        expert_activation_bytes_per_sample=dhen_tokens * cfg.d_model * act_bytes,
        local_batch=recipe.loader.local_batch_size,
        param_bytes=pbytes,
        grad_bytes=4,
    )
