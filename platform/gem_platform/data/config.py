"""The recipe's ``data`` section: where the dataset lives and, for synthetic data, its shape.

Every field has a default sized for the CPU demo; validators reject values that could only
produce an empty or meaningless dataset, naming the field in the message.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Names the synthetic generator adds on its own; configured features may not reuse them.
BUILTIN_SPARSE_FEATURES: tuple[str, ...] = ("user_id",)
NAME_MAX = 255  # bytes of one folder or file name on common filesystems (ext4, xfs, tmpfs)
PATH_MAX = 4096  # bytes of a whole path (Linux)

# The planted world's "recent" events: the last RECENT_WINDOW of a history.
RECENT_WINDOW = 8
# world long_range: the old events are those at least LONG_RANGE_GAP positions from the end.
# A 64-token block that holds a recent event reaches at most 63 older positions, a 64-token
# sliding window (model.window=64) 64, so neither holds a recent and an old event.
LONG_RANGE_GAP = 64 + RECENT_WINDOW
# Shortest history world long_range accepts: a few old events beyond the gap in every sample.
LONG_RANGE_MIN_LEN = LONG_RANGE_GAP + 16

# world lookback: a high-intent event reads the event exactly LOOKBACK_DISTANCE positions
# before it. Over 64, so neither a 64-token block nor a 64-token window holds both events.
LOOKBACK_DISTANCE = 96
# Shortest history world lookback accepts: 64 places, counted from the newest event, whose
# events have one LOOKBACK_DISTANCE before them in every sample.
LOOKBACK_MIN_LEN = LOOKBACK_DISTANCE + 64

# world recall: the newest event's category recurs at least RECALL_GAP positions before it, or
# nowhere before it. A 64-token block holding the newest event reaches 63 events back, a
# 64-token sliding window (model.window=64) 64: neither holds one of those.
RECALL_GAP = 65
# Shortest history world recall accepts: some events beyond the gap in every sample.
RECALL_MIN_LEN = RECALL_GAP + 16

World = Literal["standard", "long_range", "local", "lookback", "recall"]


class SeqLenConfig(BaseModel):
    """Distribution of behaviour-history lengths (long-tailed, like production traffic).

    - ``lognormal``: ``mean`` is the mean of the unclipped distribution, ``sigma`` the std of
      its log.
    - ``powerlaw``: Pareto with exponent ``alpha``, scaled so its unclipped mean is ``mean``.
    - ``fixed``: every history has ``mean`` events.
    All draws are clipped to ``[min, max]``.
    """

    model_config = ConfigDict(extra="forbid")

    dist: Literal["lognormal", "powerlaw", "fixed"] = "lognormal"
    mean: float = Field(128.0, gt=0)
    sigma: float = Field(1.0, gt=0)
    alpha: float = Field(2.0, gt=1.0)
    min: int = Field(16, ge=0)
    max: int = Field(2048, ge=1)

    @model_validator(mode="after")
    def _min_le_max(self) -> SeqLenConfig:
        if self.min > self.max:
            raise ValueError(f"seq_len.min ({self.min}) must be <= seq_len.max ({self.max})")
        return self


class SparseFeatureConfig(BaseModel):
    """One non-sequence categorical feature of the synthetic data.

    Ids are drawn with a popularity skew in ``[0, vocab_size)``; a multi-hot feature holds
    1..``max_ids`` ids per sample (repeats possible). Each id carries a planted effect on the
    CTR and CVR logits, so the feature is worth learning.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    vocab_size: int = Field(ge=1)
    multi_hot: bool = False
    max_ids: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _single_hot_has_one_id(self) -> SparseFeatureConfig:
        if not self.multi_hot and self.max_ids != 1:
            raise ValueError(
                f"sparse feature {self.name!r}: max_ids={self.max_ids} needs multi_hot: true"
            )
        return self


def _default_sparse() -> list[SparseFeatureConfig]:
    return [
        SparseFeatureConfig(name="region", vocab_size=100),
        SparseFeatureConfig(name="device_type", vocab_size=8),
        SparseFeatureConfig(name="hour_of_day", vocab_size=24),
        SparseFeatureConfig(name="user_segments", vocab_size=200, multi_hot=True, max_ids=6),
        SparseFeatureConfig(name="ad_creative_tags", vocab_size=500, multi_hot=True, max_ids=4),
    ]


# The shortest history each world with a known answer can plant its signal in, and why.
_WORLD_MIN_LEN = {
    "long_range": (LONG_RANGE_MIN_LEN, f"events {LONG_RANGE_GAP} or more positions from the "
                   "end carry its signal"),
    "lookback": (LOOKBACK_MIN_LEN, f"its signal lies {LOOKBACK_DISTANCE} positions before "
                 "high-intent events among the newest 64"),
    "recall": (RECALL_MIN_LEN, f"its signal lies {RECALL_GAP} or more positions before the "
               "newest event"),
}


class SyntheticConfig(BaseModel):
    """Shape of the synthetic dataset with a planted ground truth.

    Label base rates: ``ctr_base_rate`` defaults to 0.15 (higher than real ads traffic, around
    1-3%, so that a 20k-sample demo sees enough positives for AUC/NE to be stable);
    ``cvr_base_rate`` is the conversion rate among clicked samples.
    """

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, ge=0)
    num_samples: int = Field(20_000, ge=2)
    eval_fraction: float = 0.1
    num_users: int = Field(10_000, ge=1)
    num_items: int = Field(20_000, ge=1)
    num_clusters: int = Field(50, ge=2)
    num_action_types: int = Field(4, ge=1, le=127)
    seq_len: SeqLenConfig = Field(default_factory=SeqLenConfig)
    sparse_features: list[SparseFeatureConfig] = Field(default_factory=_default_sparse)
    dense_dim: int = Field(8, ge=0)
    ctr_base_rate: float = 0.15
    cvr_base_rate: float = 0.2
    rows_per_shard: int = Field(10_000, ge=1)
    world: World = Field(
        "standard",
        description="planted world: standard; long_range (part of the CTR logit needs a "
        "recent event and one more than 64 positions older together: block-local "
        "self-attention can't pair them, though pooled attention still sees both zones as "
        "bags); lookback (part of the CTR logit reads the event exactly "
        f"{LOOKBACK_DISTANCE} positions before each high-intent event: only attention from "
        "one event to another that far back, at that exact distance, sees it); recall (part "
        "of the CTR logit says whether the newest event's category occurred "
        f"{RECALL_GAP} or more positions before it: attention from the newest event to its "
        "match that far back sees it); local (the "
        "history signal comes only from the last events). See "
        "docs/synthetic-data.md",
    )

    @field_validator("eval_fraction", "ctr_base_rate", "cvr_base_rate")
    @classmethod
    def _open_unit_interval(cls, v: float, info) -> float:
        if not 0.0 < v < 1.0:
            raise ValueError(f"{info.field_name} must be strictly between 0 and 1, got {v}")
        return v

    @field_validator("sparse_features")
    @classmethod
    def _unique_names(cls, feats: list[SparseFeatureConfig]) -> list[SparseFeatureConfig]:
        seen: set[str] = set()
        for f in feats:
            if f.name in BUILTIN_SPARSE_FEATURES:
                raise ValueError(
                    f"sparse_features: {f.name!r} is added by the generator itself; "
                    f"pick another name (reserved: {', '.join(BUILTIN_SPARSE_FEATURES)})"
                )
            if f.name in seen:
                raise ValueError(f"sparse_features: name {f.name!r} appears twice")
            seen.add(f.name)
        return feats

    @model_validator(mode="after")
    def _consistent(self) -> SyntheticConfig:
        if self.num_clusters > self.num_items:
            raise ValueError(
                f"num_clusters ({self.num_clusters}) must be <= num_items ({self.num_items})"
            )
        needs = _WORLD_MIN_LEN.get(self.world)
        if needs is not None and self.seq_len.min < needs[0]:
            raise ValueError(
                f"world {self.world} needs histories of at least {needs[0]} events ({needs[1]}), "
                f"but seq_len.min is {self.seq_len.min}; set seq_len.min >= {needs[0]}"
            )
        n_eval = self.num_eval
        if n_eval < 1 or n_eval >= self.num_samples:
            raise ValueError(
                f"eval_fraction={self.eval_fraction} with num_samples={self.num_samples} gives "
                f"{n_eval} eval samples; both splits need at least one sample"
            )
        return self

    @property
    def num_eval(self) -> int:
        return int(round(self.num_samples * self.eval_fraction))

    @property
    def num_train(self) -> int:
        return self.num_samples - self.num_eval

    def fingerprint(self) -> str:
        """Hash of every field: a dataset on disk is reused only if this matches.

        ``world: standard`` is left out, so datasets written before worlds existed keep their
        hash (the standard world generates the same bytes they hold)."""
        fields = self.model_dump(mode="json")
        if fields["world"] == "standard":
            del fields["world"]
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class DataConfig(BaseModel):
    """Where the dataset lives and how to make it (``prepare.prepare_dataset`` does).

    ``source: synthetic`` generates shards into ``path`` when they are missing or were made
    from a different ``synthetic`` config; ``source: parquet`` reads an existing dataset
    directory (e.g. one written by the MovieLens converter, or a copy of one in object
    storage: ``s3://``, ``gs://``, ``hdfs://``) and ignores ``synthetic``.
    """

    model_config = ConfigDict(extra="forbid")

    source: Literal["synthetic", "parquet"] = "synthetic"
    path: str = Field("gem_data/synthetic", min_length=1,
                      description="dataset directory, or an s3:// gs:// hdfs:// URI for "
                      "source: parquet")
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    history_overflow: Literal["error", "truncate"] = Field(
        "error",
        description="a history longer than the dataset's max_seq_len (meta.json): 'error' "
        "stops with the file, row and column; 'truncate' keeps its newest max_seq_len events "
        "and counts the row in the run summary (data/truncated_histories)",
    )

    @field_validator("path")
    @classmethod
    def _names_a_filesystem_allows(cls, path: str) -> str:
        if "\0" in path:
            raise ValueError("data.path holds a NUL character, which no filesystem allows")
        if "://" in path:
            return path
        if len(path.encode()) > PATH_MAX:
            raise ValueError(f"data.path is {len(path.encode())} bytes long; systems take at "
                             f"most {PATH_MAX} bytes per path")
        for part in path.split("/"):
            if len(part.encode()) > NAME_MAX:
                shown = part if len(part) <= 40 else part[:37] + "..."
                raise ValueError(
                    f"data.path holds the name {shown!r} of {len(part.encode())} bytes; "
                    f"filesystems allow at most {NAME_MAX} bytes per folder or file name")
        return path

    @model_validator(mode="after")
    def _synthetic_is_local(self) -> DataConfig:
        if self.source == "synthetic" and "://" in self.path:
            raise ValueError(
                f"data.path {self.path!r} is a URI, but data.source synthetic writes a local "
                "directory: generate it locally (or copy one to object storage and use "
                "source: parquet)"
            )
        return self
