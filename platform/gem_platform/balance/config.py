"""The loader section of a recipe: how each rank turns its samples into local batches."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Batching = Literal["sequential", "bbs", "bbs_v2"]
CostName = Literal["length", "attention"]


class LoaderConfig(BaseModel):
    """How a data-parallel rank batches its samples, one instance per recipe (``loader:``).

    ``batching="bbs"`` is the default because it costs no communication, keeps every sample
    exactly once per epoch and removes most of the straggler overhead; ``"sequential"`` (a
    plain shuffled loader) is the baseline the loader ablation compares it against.
    """

    model_config = ConfigDict(extra="forbid")

    batching: Batching = Field(
        "bbs",
        description="'bbs' = Base Batch Shuffling within buffers of full batches; 'bbs_v2' = "
        "each batch packed to the expected work of a batch from a rolling window (rolling.py); "
        "'sequential' = plain shuffled batches.",
    )
    local_batch_size: int = Field(1024, ge=1, description="Samples per rank per step.")
    base_batch_size: int = Field(
        128, ge=1, description="Samples per base batch, the unit BBS sorts and pairs."
    )
    buffer_full_batches: int = Field(
        128,
        ge=1,
        description=(
            "How many full batches one BBS buffer spans. A rank can only balance within its "
            "buffer, so the rank-to-rank spread of step work shrinks like 1/sqrt(this). The "
            "buffer holds sample positions only (lengths are known up front), so a large one "
            "costs no memory; an epoch shorter than the buffer is one buffer (gemctl bench bbs "
            "measures the share of a global partition's gain per buffer size)."
        ),
    )
    cost: CostName = Field(
        "length",
        description=(
            "Work of a sample: 'length' = L; 'attention' = L^2 + 6*model_dim*L (attention "
            "scores and values vs. projections and a 4x FFN, per layer)."
        ),
    )
    model_dim: int = Field(
        128, ge=1, description="Hidden width d of the sequence tower (attention cost only)."
    )
    shuffle: bool = Field(True, description="Reshuffle the rank's samples every epoch.")
    seed: int = Field(0, description="Seed of the per-epoch permutation.")
    drop_last: bool = Field(
        False,
        description=(
            "Samples beyond steps_per_epoch * local_batch_size: False = spread them over the "
            "epoch's batches (each sample exactly once per epoch); True = skip them this epoch."
        ),
    )

    window_samples: int | None = Field(
        None,
        ge=1,
        description=(
            "Stream the split: each rank holds at most this many samples in memory, reads its "
            "row groups in a seeded order and starts training after one window. None = read "
            "the rank's whole share into memory first (bbs_v2 then packs from a window of 8 "
            "local batches). Works with batching 'sequential' (a shuffle buffer) and 'bbs_v2'; "
            "give it several local batches."
        ),
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> LoaderConfig:
        if self.window_samples is not None and self.batching == "bbs":
            raise ValueError(
                "loader.window_samples needs loader.batching 'bbs_v2' or 'sequential': 'bbs' "
                "plans buffers over the rank's whole permutation, which a streaming window "
                "does not hold."
            )
        if self.window_samples is not None and self.window_samples < self.local_batch_size:
            raise ValueError(
                f"loader.window_samples ({self.window_samples}) must hold at least one local "
                f"batch (loader.local_batch_size = {self.local_batch_size}); 8 or more local "
                "batches pack well."
            )
        if self.batching == "bbs":
            if self.local_batch_size % self.base_batch_size:
                raise ValueError(
                    f"loader.local_batch_size ({self.local_batch_size}) must be a multiple of "
                    f"loader.base_batch_size ({self.base_batch_size}) when loader.batching is "
                    "'bbs': set local_batch_size to k * base_batch_size (GEM uses 8+ base "
                    "batches of 128)."
                )
            if self.local_batch_size // self.base_batch_size < 2:
                raise ValueError(
                    f"loader.local_batch_size ({self.local_batch_size}) holds fewer than 2 "
                    f"base batches of loader.base_batch_size ({self.base_batch_size}); BBS "
                    "has nothing to pair: lower base_batch_size or use batching 'sequential'."
                )
        return self

    @property
    def base_batches_per_full_batch(self) -> int:
        return self.local_batch_size // self.base_batch_size
