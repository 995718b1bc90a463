"""DataConfig: defaults are valid, impossible values are rejected naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gem_platform.data.config import DataConfig, SyntheticConfig


def test_defaults_are_valid_and_demo_sized() -> None:
    cfg = DataConfig()
    assert cfg.source == "synthetic"
    assert cfg.synthetic.seq_len.dist == "lognormal"
    assert (cfg.synthetic.seq_len.min, cfg.synthetic.seq_len.max) == (16, 2048)
    assert cfg.synthetic.num_train + cfg.synthetic.num_eval == cfg.synthetic.num_samples


@pytest.mark.parametrize(
    ("synthetic", "needle"),
    [
        ({"seq_len": {"min": 100, "max": 10}}, "seq_len.min"),
        ({"eval_fraction": 0.0}, "eval_fraction"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"ctr_base_rate": 1.5}, "ctr_base_rate"),
        ({"cvr_base_rate": 0.0}, "cvr_base_rate"),
        ({"seq_len": {"alpha": 0.5}}, "alpha"),
        ({"seq_len": {"dist": "uniform"}}, "dist"),
        ({"num_items": 10, "num_clusters": 50}, "num_clusters"),
        ({"num_samples": 5, "eval_fraction": 0.01}, "eval_fraction"),
        ({"sparse_features": [{"name": "a", "vocab_size": 0}]}, "vocab_size"),
        ({"sparse_features": [{"name": "a", "vocab_size": 5, "max_ids": 3}]}, "multi_hot"),
        (
            {"sparse_features": [{"name": "a", "vocab_size": 5}, {"name": "a", "vocab_size": 6}]},
            "appears twice",
        ),
        ({"sparse_features": [{"name": "user_id", "vocab_size": 5}]}, "user_id"),
    ],
)
def test_rejects_impossible_values(synthetic: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        DataConfig(synthetic=synthetic)
    assert needle in str(err.value)


def test_unknown_keys_are_rejected() -> None:
    with pytest.raises(ValidationError, match="num_sample"):
        DataConfig(synthetic={"num_sample": 10})
    with pytest.raises(ValidationError, match="bogus"):
        DataConfig(bogus=1)


def test_fingerprint_tracks_every_field() -> None:
    a = SyntheticConfig()
    assert a.fingerprint() == SyntheticConfig().fingerprint()
    assert a.fingerprint() != SyntheticConfig(seed=1).fingerprint()
    assert a.fingerprint() != SyntheticConfig(seq_len={"mean": 64}).fingerprint()
