"""World recall: its term says whether the newest event's category occurred RECALL_GAP or more
positions before it, which no 64-token block or window holding the newest event can tell (no
event of its category lies nearer); the dataset's meta records what a model blind to it
reaches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from gem_platform.data.ceilings import describe_ceilings
from gem_platform.data.config import RECALL_GAP, RECALL_MIN_LEN, DataConfig, SyntheticConfig
from gem_platform.data.synthetic import PlantedWorld, _rng, generate_synthetic
from gem_platform.data.worlds import recall_history, recall_sign
from gem_platform.model.attention import SelfAttentionSpec
from gem_platform.model.sequence import SequenceTower


def _config(**synthetic) -> SyntheticConfig:
    tree = {"world": "recall", "num_samples": 4000, "num_users": 300, "num_items": 600,
            "num_clusters": 40, "seq_len": {"dist": "lognormal", "mean": 110,
                                            "min": RECALL_MIN_LEN, "max": 160}}
    return SyntheticConfig.model_validate({**tree, **synthetic})


def test_recall_sign_reads_only_matches_the_gap_or_more_back() -> None:
    far = np.array([7] + [1] * (RECALL_GAP - 1) + [7])  # 7 again exactly RECALL_GAP back: +1
    near = np.array([2] * RECALL_GAP + [5, 7])  # 7 only at the newest itself: -1
    just = np.array([1] * RECALL_GAP + [7, 9, 7])  # 7 two events back, within the gap: -1
    offsets = np.cumsum([0, far.size, near.size, just.size, 0])
    got = recall_sign(offsets, np.concatenate([far, near, just]))
    np.testing.assert_array_equal(got, [1.0, -1.0, -1.0, 0.0])  # an empty history: 0


def test_histories_hide_the_newest_category_from_the_gap_and_recur_for_half() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(RECALL_MIN_LEN, 200, 3000)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    categories = recall_history(rng, offsets, 40)
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        history = categories[start:end]
        assert not (history[-RECALL_GAP:-1] == history[-1]).any()
    sign = recall_sign(offsets, categories)
    assert 0.45 < (sign > 0).mean() < 0.55
    # every other event is uniform: the newest category's share elsewhere tells little
    assert np.bincount(categories, minlength=40).min() > 0.8 * categories.size / 40


def test_world_needs_histories_past_the_gap() -> None:
    with pytest.raises(ValidationError, match=f"seq_len.min >= {RECALL_MIN_LEN}"):
        _config(seq_len={"min": RECALL_MIN_LEN - 1, "max": 300})


def test_the_planted_term_is_the_recall_sign() -> None:
    world = PlantedWorld.build(_config())
    arrays = world.sample(_rng(0, 7, 0), 2000)
    categories = world.item_cluster[arrays.seq_item_ids]
    terms = world.terms(arrays).ctr
    assert "long_affinity" not in terms  # no history signal beyond the recent one but this
    np.testing.assert_allclose(terms["recall"], recall_sign(arrays.seq_offsets, categories))


def test_meta_records_the_ceiling_without_the_term(tmp_path: Path) -> None:
    syn = _config(num_samples=6000, eval_fraction=0.5)
    meta = generate_synthetic(DataConfig(source="synthetic", path=str(tmp_path / "recall"),
                                         synthetic=syn))
    ceiling = meta.planted_auc["ctr"]
    blind = meta.extra["without_world_term_auc"]["ctr"]
    assert meta.extra["world"] == "recall"
    assert meta.extra["term_auc"]["ctr"]["recall"] > 0.6
    assert blind < ceiling - 0.05, (blind, ceiling)
    assert "zone_bags_auc" not in meta.extra  # no zone of the history holds the answer
    assert f"without the recall term {blind:.3f}" in describe_ceilings(meta.planted_auc,
                                                                        meta.extra)[0]


@pytest.mark.parametrize("side_qk, shared_qk", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("kind, layers, blind", [
    ("block64", 3, True),     # blocks never cross, however many layers
    ("sliding", 1, True),     # one 64-token window reaches 63 events back: none of the gap's
    ("full", 1, False),
])
def test_only_attention_across_blocks_sees_the_newest_events_match(kind: str, layers: int,
                                                                   blind: bool,
                                                                   side_qk: bool,
                                                                   shared_qk: bool) -> None:
    """The newest token's output of the model's sequence tower, and its last block's attention
    read (what model.newest_attention gives DHEN), with every event RECALL_GAP or
    more before it replaced (where the recall world's match lies): unchanged under
    block-local attention, changed under full attention; histories of every length modulo
    64, so every way a block edge can fall."""
    lengths = np.arange(RECALL_MIN_LEN, RECALL_MIN_LEN + 64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    owner = np.repeat(np.arange(lengths.size), lengths)
    old = torch.as_tensor(offsets[owner + 1] - 1 - np.arange(owner.size) >= RECALL_GAP)
    torch.manual_seed(0)
    spec = SelfAttentionSpec(kind=kind, window=64, causal=True)
    tower = SequenceTower(16, 2, layers, spec, qk_norm=True, expose_attention=True,
                          side_qk=side_qk, shared_qk=shared_qk).eval()
    x = torch.randn(int(offsets[-1]), 16)
    y = x.clone()
    y[old] = torch.randn(int(old.sum()), 16)
    # with side_qk, queries and keys from a side input (model.attention_qk=category), changed
    # with the events
    side_x = torch.randn_like(x) if side_qk else None
    side_y = None
    if side_qk:
        side_y = side_x.clone()
        side_y[old] = torch.randn(int(old.sum()), 16)
    newest = torch.as_tensor(offsets[1:] - 1)
    longest = int(lengths.max())
    with torch.no_grad():
        before = tower.forward_with_attention(x, torch.as_tensor(offsets), longest, side_x)
        after = tower.forward_with_attention(y, torch.as_tensor(offsets), longest, side_y)
    # the tower's output and the last block's attention read (model.newest_attention) alike
    for was, now in zip(before, after, strict=True):
        was, now = was[newest], now[newest]
        if blind:
            torch.testing.assert_close(now, was, rtol=0, atol=0)
        else:
            assert (now - was).abs().amax(dim=1).gt(1e-3).float().mean() > 0.9
