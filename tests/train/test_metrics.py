"""NE, AUC and calibration against hand-computed values, alone and reduced over 2 gloo
processes."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gem_platform.train.metrics import TaskEvaluator, auc_standard_error, normalized_entropy

LOGITS = torch.tensor([-2.0, 0.5, -0.3, 1.2, -1.0, 0.8])
LABELS = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.0])


def hand_calibration(mask: list[bool] | None = None) -> float:
    """Predicted positives over actual ones: sum of sigmoid(logit) / sum of labels."""
    keep = mask or [True] * len(LABELS)
    p = [1 / (1 + math.exp(-x)) for x, k in zip(LOGITS.tolist(), keep, strict=True) if k]
    y = [v for v, k in zip(LABELS.tolist(), keep, strict=True) if k]
    return sum(p) / sum(y)


def hand_scores() -> tuple[float, float]:
    p = [1 / (1 + math.exp(-x)) for x in LOGITS.tolist()]
    y = LABELS.tolist()
    pairs = list(zip(p, y, strict=True))
    ll = -sum(yi * math.log(pi) + (1 - yi) * math.log(1 - pi) for pi, yi in pairs) / len(y)
    base = sum(y) / len(y)
    h = -(base * math.log(base) + (1 - base) * math.log(1 - base))
    pos = [pi for pi, yi in pairs if yi]
    neg = [pi for pi, yi in pairs if not yi]
    auc = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))
    return ll / h, auc


def test_normalized_entropy_of_base_rate_predictor_is_one():
    p = 0.2
    ll = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert normalized_entropy(ll, p) == pytest.approx(1.0)
    assert math.isnan(normalized_entropy(0.1, 0.0))


def test_evaluator_matches_hand_computation():
    ev = TaskEvaluator()
    ev.update(LOGITS[:3], LABELS[:3])
    ev.update(LOGITS[3:], LABELS[3:])
    s = ev.compute()
    ne, auc = hand_scores()
    assert s.ne == pytest.approx(ne, rel=1e-6)
    assert s.auc == pytest.approx(auc)
    assert auc == pytest.approx(7 / 8)  # one negative (0.8) outranks one positive (0.5)
    assert s.count == 6 and s.base_rate == pytest.approx(2 / 6)
    assert s.calibration == pytest.approx(hand_calibration(), rel=1e-9)
    assert s.calibration == pytest.approx(2.894660 / 2, rel=1e-6)  # over-predicts positives


def test_calibration_without_positives_is_undefined():
    ev = TaskEvaluator()
    ev.update(LOGITS[:1], LABELS[:1])
    assert math.isnan(ev.compute().calibration)


def test_mask_selects_samples():
    ev = TaskEvaluator()
    mask = torch.tensor([True, True, True, False, False, False])
    ev.update(LOGITS, LABELS, mask=mask)
    s = ev.compute()
    assert s.count == 3 and s.base_rate == pytest.approx(1 / 3)
    assert s.calibration == pytest.approx(hand_calibration(mask.tolist()), rel=1e-9)


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ev = TaskEvaluator()
    # uneven shards: rank 0 gets 4 samples, rank 1 gets 2
    sl = slice(0, 4) if rank == 0 else slice(4, 6)
    ev.update(LOGITS[sl], LABELS[sl])
    s = ev.compute()
    out[rank] = (s.ne, s.auc, s.count, s.calibration, s.se_ne, s.se_auc)
    dist.destroy_process_group()


def test_distributed_reduction_equals_single_process():
    from tests.conftest import free_port

    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
    ne, auc = hand_scores()
    alone = TaskEvaluator()
    alone.update(LOGITS, LABELS)
    whole = alone.compute()
    for rank in (0, 1):
        r_ne, r_auc, count, cal, se_ne, se_auc = out[rank]
        assert count == 6 and cal == pytest.approx(hand_calibration(), rel=1e-9)
        assert r_ne == pytest.approx(ne, rel=1e-6)
        assert r_auc == pytest.approx(auc)
        assert (se_ne, se_auc) == pytest.approx((whole.se_ne, whole.se_auc), rel=1e-6)


def test_standard_errors_match_the_spread_over_fresh_samples():
    """The standard errors a single evaluation reports are what NE and AUC actually vary by
    from one held-out sample to the next: 300 samples of 1,000 from one model and world."""
    g = torch.Generator().manual_seed(0)
    scores = []
    for _ in range(300):
        signal = torch.randn(1000, generator=g)
        labels = (torch.rand(1000, generator=g) < torch.sigmoid(1.5 * signal - 1.2)).float()
        ev = TaskEvaluator()
        ev.update(1.2 * signal - 1.0, labels)  # a model close to, not equal to, the truth
        scores.append(ev.compute())
    # NE's delta method is close; Hanley-McNeil's AUC error is known to err large (it assumes
    # exponential score distributions): here by ~14%, on the safe side
    for name, low, high in (("ne", 0.9, 1.1), ("auc", 1.0, 1.25)):
        values = torch.tensor([getattr(s, name) for s in scores], dtype=torch.float64)
        reported = torch.tensor([getattr(s, f"se_{name}") for s in scores], dtype=torch.float64)
        spread, mean = float(values.std()), float(reported.mean())
        assert float(reported.std()) < 0.1 * mean  # each evaluation says about the same
        assert low * spread <= mean <= high * spread, name


def test_standard_errors_are_undefined_without_both_labels():
    ev = TaskEvaluator()
    ev.update(LOGITS, torch.zeros_like(LABELS))
    s = ev.compute()
    assert math.isnan(s.se_ne) and math.isnan(s.se_auc)
    assert math.isnan(auc_standard_error(0.7, 0, 10)) and auc_standard_error(0.7, 5, 10) > 0
