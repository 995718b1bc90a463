"""What a dataset directory holds, written beside its Parquet shards as meta.json.

The model is sized from it (vocabularies, feature names, dense width), so a recipe never
repeats what the data already knows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

META_FILE = "meta.json"


@dataclass(frozen=True)
class SparseFeatureSpec:
    """One non-sequence categorical feature: ids in [0, vocab_size)."""

    name: str
    vocab_size: int
    multi_hot: bool = False


@dataclass
class DatasetMeta:
    source: str  # "synthetic" or "movielens-100k" / "movielens-1m"
    num_items: int  # item ids are 1..num_items (0 = none)
    num_action_types: int
    sparse_features: list[SparseFeatureSpec]
    dense_dim: int
    num_train: int
    num_eval: int
    ctr_base_rate: float
    cvr_base_rate: float  # among clicked samples
    # AUC of the planted ground-truth scorer on the eval split (the ceiling); None for real data.
    planted_auc: dict[str, float] | None = None
    max_seq_len: int = 0
    # Items carry a category in [0, num_categories) (a small vocabulary, e.g. genres), stored
    # beside every history event and the candidate, so the model can learn history-candidate
    # affinity per category from few samples instead of per item. 0: the data has none.
    num_categories: int = 0
    extra: dict = field(default_factory=dict)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / META_FILE
        path.write_text(json.dumps(asdict(self), indent=2, sort_keys=True))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> DatasetMeta:
        path = Path(directory) / META_FILE
        raw = json.loads(path.read_text())
        raw["sparse_features"] = [SparseFeatureSpec(**s) for s in raw["sparse_features"]]
        return cls(**raw)
