"""World lookback, the attention ablation's positive control: its term reads the event exactly
LOOKBACK_DISTANCE positions before each high-intent event, which no 64-token block holds with
it, and which no bag of events tells; the dataset's meta records what a model blind to it
reaches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from gem_platform.data.ceilings import describe_ceilings
from gem_platform.data.config import (
    LOOKBACK_DISTANCE,
    LOOKBACK_MIN_LEN,
    DataConfig,
    SyntheticConfig,
)
from gem_platform.data.synthetic import PlantedWorld, _rng, generate_synthetic
from gem_platform.data.worlds import LOOKBACK_ZONE, kind, lookback_balance

HISTORY = LOOKBACK_MIN_LEN  # fixed-length histories: every zone holds the same positions


def _config(**synthetic) -> SyntheticConfig:
    tree = {"world": "lookback", "num_samples": 4000, "num_users": 300, "num_items": 600,
            "num_clusters": 20, "seq_len": {"dist": "fixed", "mean": HISTORY,
                                            "min": HISTORY, "max": HISTORY}}
    return SyntheticConfig.model_validate({**tree, **synthetic})


def test_lookback_reads_the_event_exactly_the_distance_back() -> None:
    length = LOOKBACK_DISTANCE + 10
    categories = np.full(length, 3)  # odd
    intent = np.zeros(length, dtype=bool)
    intent[[-1, -3, -5, 5]] = True  # the oldest mark has nothing that far back: not counted
    categories[-1] = 2  # an even mark whose event that far back is odd: -1
    categories[length - 3 - LOOKBACK_DISTANCE] = 4  # even, but behind an odd mark: -1
    # the odd mark at -5 has an odd event exactly that far back (+1), an even one next to it
    categories[length - 5 - LOOKBACK_DISTANCE + 1] = 6
    got = lookback_balance(np.array([0, length, length + 5]),
                           np.concatenate([categories, np.zeros(5, np.int64)]),
                           np.concatenate([intent, np.zeros(5, bool)]))
    np.testing.assert_allclose(got, [-1 / 3, 0.0])  # none that far back: 0
    assert kind(np.arange(4)).tolist() == [1.0, -1.0, 1.0, -1.0]


def test_world_needs_histories_past_the_distance() -> None:
    with pytest.raises(ValidationError, match=f"seq_len.min >= {LOOKBACK_MIN_LEN}"):
        _config(seq_len={"min": LOOKBACK_MIN_LEN - 1, "max": 300})
    with pytest.raises(ValidationError, match="lookback"):
        _config(world="lookbak")


def _zone_features(offsets: np.ndarray, categories: np.ndarray, intent: np.ndarray,
                   clusters: int, pairs: bool) -> np.ndarray:
    """Per zone of LOOKBACK_ZONE positions (from the end): the bag of its events' categories
    and the bag of its high-intent events' categories; with ``pairs``, also each zone's
    high-intent kinds summed times the mean kind of the zone LOOKBACK_DISTANCE further back
    (what comparing pooled zones can tell)."""
    n = offsets.size - 1
    zones = HISTORY // LOOKBACK_ZONE
    owner = np.repeat(np.arange(n), np.diff(offsets))
    zone = (offsets[owner + 1] - 1 - np.arange(owner.size)) // LOOKBACK_ZONE
    bags = np.zeros((n, zones, 2 * clusters))
    np.add.at(bags, (owner, zone, categories), 1.0)
    np.add.at(bags, (owner[intent], zone[intent], clusters + categories[intent]), 1.0)
    features = [bags.reshape(n, -1)]
    if pairs:
        kinds = kind(np.arange(clusters))
        mean_kind = bags[:, :, :clusters] @ kinds / LOOKBACK_ZONE
        marks = bags[:, :, clusters:] @ kinds
        shift = LOOKBACK_DISTANCE // LOOKBACK_ZONE
        features.append(marks[:, :-shift] * mean_kind[:, shift:])
    return np.concatenate(features, axis=1)


def _held_out_corr(x: np.ndarray, y: np.ndarray) -> float:
    """A ridge least-squares fit on the first half, its correlation with ``y`` on the second."""
    half = len(y) // 2
    mean, std = x[:half].mean(0), np.maximum(x[:half].std(0), 1e-6)
    z = np.concatenate([(x - mean) / std, np.ones((len(y), 1))], axis=1)
    w = np.linalg.solve(z[:half].T @ z[:half] + 10.0 * np.eye(z.shape[1]), z[:half].T @ y[:half])
    return float(np.corrcoef(z[half:] @ w, y[half:])[0, 1])


def test_bags_of_events_do_not_tell_the_lookback_term() -> None:
    """The term against a linear fit on every zone's bags of categories (what pooling with
    recency sees of single events): no correlation, as every event is drawn alike at every
    position and the term's mean is 0 whatever one zone holds; comparing zones the distance
    apart recovers only part of it, as each mark's zone that far back holds seven other
    events besides its target."""
    cfg = _config()
    world = PlantedWorld.build(cfg)
    arrays = world.sample(_rng(0, 7, 0), 8000)
    categories = world.item_cluster[arrays.seq_item_ids]
    intent = arrays.seq_action_types == cfg.num_action_types - 1
    term = lookback_balance(arrays.seq_offsets, categories, intent)
    args = (arrays.seq_offsets, categories, intent, cfg.num_clusters)
    bags = _held_out_corr(_zone_features(*args, pairs=False), term)
    zones = _held_out_corr(_zone_features(*args, pairs=True), term)
    assert abs(bags) < 0.05, bags
    assert 0.1 < zones < 0.6, zones


def test_meta_records_the_ceiling_with_and_without_the_term(tmp_path: Path) -> None:
    """What block-local attention must lose: the ceiling without the lookback term and
    through zone bags both lie well below the ceiling, and the CLI's lines say so."""
    syn = _config(num_samples=6000, eval_fraction=0.5)
    meta = generate_synthetic(DataConfig(source="synthetic", path=str(tmp_path / "lookback"),
                                         synthetic=syn))
    ceiling = meta.planted_auc["ctr"]
    blind = meta.extra["without_world_term_auc"]["ctr"]
    bags = meta.extra["zone_bags_auc"]["ctr"]
    assert meta.extra["world"] == "lookback"
    assert meta.extra["term_auc"]["ctr"]["lookback"] > 0.6
    assert blind <= bags < ceiling - 0.03, (blind, bags, ceiling)
    lines = describe_ceilings(meta.planted_auc, meta.extra)
    assert f"without the lookback term {blind:.3f}" in lines[0]
    assert "with the lookback term through zone bags" in lines[0]

