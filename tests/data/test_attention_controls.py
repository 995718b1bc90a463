"""The worlds that answer the attention ablation: block-local self-attention never lets a
recent event see an old one, how much of the long-range term the zones' bags still carry, and
the shipped controls sweep pairs the arms of each world (lookback, the positive control, and
local)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gem_platform.data.ceilings import describe_ceilings
from gem_platform.data.config import (
    LONG_RANGE_GAP,
    LONG_RANGE_MIN_LEN,
    LOOKBACK_DISTANCE,
    LOOKBACK_MIN_LEN,
    RECENT_WINDOW,
    DataConfig,
)
from gem_platform.data.synthetic import generate_synthetic
from gem_platform.data.worlds import zone_bag_overlap
from gem_platform.model.attention import SelfAttentionSpec
from gem_platform.model.sequence import SequenceTower
from gem_platform.sweep.config import load_sweep

REPO = Path(__file__).resolve().parents[2]


def _histories() -> tuple[torch.Tensor, np.ndarray]:
    """Offsets of 64 histories of the long-range world's shortest lengths and up, one per
    remainder modulo 64 (every size of the last 64-token block, so every way a block edge
    can fall in or beside the recent window), and each event's position from the end."""
    lengths = np.arange(LONG_RANGE_MIN_LEN, LONG_RANGE_MIN_LEN + 64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    owner = np.repeat(np.arange(lengths.size), lengths)
    return torch.as_tensor(offsets), offsets[owner + 1] - 1 - np.arange(owner.size)


@pytest.mark.parametrize("kind, layers, blind", [
    ("block64", 3, True),     # blocks never cross, however many layers
    ("sliding", 1, True),     # one 64-token window reaches 64 back, the old zone starts at 72
    ("full", 1, False),
])
def test_only_attention_across_blocks_sees_the_old_zone_from_the_recent_one(
        kind: str, layers: int, blind: bool) -> None:
    """The recent tokens' outputs of the model's sequence tower with the old zone's tokens
    (LONG_RANGE_GAP or more back) replaced: unchanged under block-local attention, as the
    world's long-range term needs, changed under full attention."""
    offsets, from_end = _histories()
    torch.manual_seed(0)
    spec = SelfAttentionSpec(kind=kind, window=64, causal=True)
    tower = SequenceTower(16, 2, layers, spec, qk_norm=True).eval()
    x = torch.randn(int(offsets[-1]), 16)
    old = torch.as_tensor(from_end >= LONG_RANGE_GAP)
    recent = torch.as_tensor(from_end < RECENT_WINDOW)
    y = x.clone()
    y[old] = torch.randn(int(old.sum()), 16)
    max_len = int(offsets.diff().max())
    with torch.no_grad():
        before = tower(x, offsets, max_len)[recent]
        after = tower(y, offsets, max_len)[recent]
    if blind:
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    else:
        assert (after - before).abs().amax(dim=1).gt(1e-3).float().mean() > 0.9


@pytest.mark.parametrize("kind, layers, blind", [
    ("block64", 3, True),     # blocks never cross, however many layers
    ("sliding", 1, True),     # one 64-token window reaches 64 back, the target lies 96 back
    ("full", 1, False),
])
def test_only_attention_across_blocks_sees_the_lookback_target(kind: str, layers: int,
                                                               blind: bool) -> None:
    """A high-intent event's output of the sequence tower (with RoPE) with the event
    LOOKBACK_DISTANCE before it replaced, the lookback world's signal: unchanged under
    block-local attention, changed under full attention. One such event per history, at
    every place from the newest back (so every way block edges fall between the two)."""
    lengths = np.arange(LOOKBACK_MIN_LEN, LOOKBACK_MIN_LEN + 64)  # every block edge
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    marks = offsets[1:] - 1 - np.arange(lengths.size)  # 0..63 places from the end
    torch.manual_seed(0)
    spec = SelfAttentionSpec(kind=kind, window=64, causal=True, rope_base=10000.0)
    tower = SequenceTower(16, 2, layers, spec, qk_norm=True).eval()
    x = torch.randn(int(offsets[-1]), 16)
    y = x.clone()
    targets = torch.as_tensor(marks - LOOKBACK_DISTANCE)
    y[targets] = torch.randn(targets.numel(), 16)
    max_len = int(lengths.max())
    with torch.no_grad():
        before = tower(x, torch.as_tensor(offsets), max_len)[marks]
        after = tower(y, torch.as_tensor(offsets), max_len)[marks]
    if blind:
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    else:
        assert (after - before).abs().amax(dim=1).gt(1e-3).float().mean() > 0.9


def test_shipped_controls_pair_both_worlds(monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    plan = load_sweep(REPO / "recipes" / "ablations" / "attention_controls.yaml")
    arms = {a.name: a.recipe for a in plan.arms}
    assert {n: (r.model.attention, r.data.synthetic.world) for n, r in arms.items()} == {
        "full_lookback": ("full", "lookback"), "block64_lookback": ("block64", "lookback"),
        "full_local": ("full", "local"), "block64_local": ("block64", "local")}
    assert plan.baseline == "full_lookback" and len(plan.seeds) >= 3
    assert plan.gates.max_ne_regression_pct == 0.2
    # one dataset per world, with histories long enough for the lookback term
    assert arms["full_lookback"].data.path == arms["block64_lookback"].data.path
    assert arms["full_local"].data.path == arms["block64_local"].data.path
    assert arms["full_local"].data.path != arms["full_lookback"].data.path
    assert all(r.data.synthetic.seq_len.min >= LOOKBACK_MIN_LEN for r in arms.values())
    # rotary positions in every arm: only they let full attention read an exact distance
    assert all(r.model.causal and r.model.rope for r in arms.values())


def test_zone_bag_overlap_is_the_recent_share_times_the_root_of_the_old_share() -> None:
    # one history of 100 events: the oldest four of categories 1, 1, 1, 2; recent 1, 3, 4 x 6
    categories = np.full(100, 9)
    categories[:4] = [1, 1, 1, 2]  # the oldest events, LONG_RANGE_GAP or more from the end
    categories[-2:] = [1, 3]
    categories[-RECENT_WINDOW:-2] = 4
    old = (100 - 1 - np.arange(100)) >= LONG_RANGE_GAP
    old_share = {c: float((categories[old] == c).mean()) for c in (1, 3, 4)}
    want = (old_share[1] ** 0.5 + old_share[3] ** 0.5 + 6 * old_share[4] ** 0.5) / RECENT_WINDOW
    got = zone_bag_overlap(np.array([0, 100]), categories)
    assert got.tolist() == pytest.approx([want])


def test_zone_bags_carry_part_of_the_long_range_term(tmp_path: Path) -> None:
    """The long-range world's meta: its ceiling through zone bags (no recent event ever
    attends to an old one) lies between the ceiling without the long-range term and the full
    ceiling, and says how much of the term block-local attention can still reach."""
    tree = {"source": "synthetic", "path": str(tmp_path / "lr"), "synthetic": {
        "world": "long_range", "num_samples": 6000, "eval_fraction": 0.5, "num_users": 300,
        "num_items": 300, "seq_len": {"dist": "lognormal", "mean": 128, "min": 96, "max": 200}}}
    meta = generate_synthetic(DataConfig.model_validate(tree))
    ceiling = meta.planted_auc["ctr"]
    bags = meta.extra["zone_bags_auc"]["ctr"]
    assert "cvr" not in meta.extra["zone_bags_auc"]  # the term is CTR's only
    assert meta.extra["term_auc"]["ctr"]["long_range"] > 0.6
    assert 0.5 < bags < ceiling
    assert any("through zone bags" in line
               for line in describe_ceilings(meta.planted_auc, meta.extra))
