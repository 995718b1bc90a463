"""Pooled attention's mean base: each sample's mean value vector added to GDPA's output, so an
untrained model already passes its history to the prediction (GDPA's activation is ~0 at
small scores)."""

from __future__ import annotations

import torch

from gem_platform.model.interaction import PooledAttention, segment_mean

LENGTHS = [3, 0, 1, 7]


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def test_segment_mean_is_each_samples_mean_and_zero_when_empty():
    torch.manual_seed(0)
    offsets = _offsets(LENGTHS)
    values = torch.randn(int(offsets[-1]), 2, 3, requires_grad=True)
    got = segment_mean(values, offsets)
    for i, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)):
        want = values[lo:hi].mean(0) if hi > lo else torch.zeros(2, 3)
        torch.testing.assert_close(got[i], want)
    got.sum().backward()
    # each row's gradient is 1 / its sample's length
    rows = torch.repeat_interleave(torch.tensor([1 / n for n in LENGTHS if n]),
                                   torch.tensor([n for n in LENGTHS if n]))
    torch.testing.assert_close(values.grad, rows.view(-1, 1, 1).expand(-1, 2, 3))


def _pair(mean_base: bool, seed: int = 0) -> PooledAttention:
    torch.manual_seed(seed)
    return PooledAttention(16, 2, 2, "silu", "pytorch", mean_base=mean_base)


def test_mean_base_adds_the_mean_value_to_gdpa():
    offsets = _offsets(LENGTHS)
    torch.manual_seed(1)
    x, ad = torch.randn(int(offsets[-1]), 16), torch.randn(len(LENGTHS), 16)
    with_mean, gdpa_only = _pair(True), _pair(False)
    v = with_mean.kv(x).view(-1, 2, 2, 8)[:, 1]
    mean = segment_mean(v, offsets).reshape(len(LENGTHS), 1, 16)
    want = gdpa_only(x, offsets, max(LENGTHS), ad) + (mean @ with_mean.out.weight.T)
    torch.testing.assert_close(with_mean(x, offsets, max(LENGTHS), ad), want)


def test_mean_base_opens_the_history_path_of_an_untrained_model():
    """At initialization the pooled output's gradient reaches the history tokens through the
    mean: many times larger than through GDPA alone."""
    offsets = _offsets([40, 60, 25, 80])
    torch.manual_seed(2)
    x0, ad = torch.randn(int(offsets[-1]), 16), torch.randn(4, 16)
    norms = {}
    for mean_base in (True, False):
        x = x0.clone().requires_grad_(True)
        _pair(mean_base)(x, offsets, 80, ad).pow(2).sum().backward()
        norms[mean_base] = x.grad.norm().item()
    assert norms[True] > 5 * norms[False], norms
