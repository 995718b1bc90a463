"""The logistic regressions: their gradient, and that they learn on demo-like data."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gem_platform.reference.config import LinearReferenceConfig
from gem_platform.reference.features import Bags
from gem_platform.reference.fit import LinearModel, TorchBags, fit_and_score


def test_bag_gradient_matches_embedding_bag_autograd():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 7, 40)  # empty bags included
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    bags = Bags(rng.integers(0, 50, offsets[-1]).astype(np.int64),
                rng.standard_normal(offsets[-1]).astype(np.float32), offsets)
    model = LinearModel(50, (0.2, 0.4))
    with torch.no_grad():
        for weight in model.weights:
            weight.normal_()
    upstream = torch.randn(40, 2)
    torch_bags = TorchBags.of(bags, 0, 40)
    (model(torch_bags) * upstream).sum().backward()
    for task, weight in enumerate(model.weights):
        ref = weight.detach().clone().requires_grad_(True)
        out = F.embedding_bag(torch_bags.indices, ref, torch_bags.offsets, mode="sum",
                              per_sample_weights=torch_bags.weights)
        (out[:, 0] * upstream[:, task]).sum().backward()
        torch.testing.assert_close(weight.grad, ref.grad)
    torch.testing.assert_close(model.bias.grad, upstream.sum(0))


def test_bias_starts_at_the_base_rates():
    model = LinearModel(3, (0.2, 0.5))
    torch.testing.assert_close(torch.sigmoid(model.bias.detach()), torch.tensor([0.2, 0.5]))


@pytest.mark.parametrize("keep_mb", [0, 256], ids=["streamed-every-epoch", "kept"])
def test_learns_beyond_the_base_rate_from_streamed_chunks(small_dataset, keep_mb):
    """On demo-like data, small chunks (the split read in 24 pieces per epoch), streamed
    again every epoch or kept after the first: both tasks predict better than their base
    rate, CTR well above chance; scored on the whole eval split by the run's own metrics."""
    path, meta = small_dataset
    cfg = replace(LinearReferenceConfig(), chunk_rows=500, keep_mb=keep_mb)
    out = fit_and_score(path, meta, cfg)
    ctr, cvr = out.scores["ctr"], out.scores["cvr"]
    assert out.train_samples == cfg.epochs * meta.num_train
    assert ctr.count == meta.num_eval
    assert ctr.base_rate == pytest.approx(meta.extra["eval_ctr_rate"])
    assert ctr.ne < 0.95 and ctr.auc > 0.68, ctr
    assert cvr.ne < 1.0 and cvr.auc > 0.55, cvr
    assert 0.8 < ctr.calibration < 1.2
    again = fit_and_score(path, meta, cfg)
    assert again.scores["ctr"].ne == ctr.ne and again.scores["cvr"].auc == cvr.auc


def test_the_fitted_references_eval_logits_are_what_it_is_scored_on(small_dataset):
    """FittedReference.eval_logits (what `gemctl bench terms --reference` fits on the planted
    terms) are the logits the scores come from: their CTR AUC is the reference's own, and the
    labels beside them are the eval split's."""
    from gem_platform.data.ceilings import auc
    from gem_platform.reference.fit import fit

    path, meta = small_dataset
    cfg = replace(LinearReferenceConfig(), chunk_rows=500)
    fitted = fit(path, meta, cfg)  # what fit_and_score trains and then scores
    logits, labels = fitted.eval_logits(path, meta, cfg)
    assert logits.shape == labels.shape == (meta.num_eval, 2)
    assert labels[:, 0].mean() == pytest.approx(meta.extra["eval_ctr_rate"])
    scored = fitted.evaluate(path, meta, cfg)["ctr"]
    assert auc(logits[:, 0], labels[:, 0]) == pytest.approx(scored.auc, abs=1e-6)
