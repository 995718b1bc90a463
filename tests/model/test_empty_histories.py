"""A batch whose every behaviour history is empty (new users) trains like any other: the
sequence tower sees zero tokens and must not fail reshaping them."""

from __future__ import annotations

import pytest
import torch

from gem_platform.model import GemModel
from gem_platform.recipe import ModelConfig
from gem_platform.train.loop import compute_loss


@pytest.mark.parametrize("shared_qk", [False, True])
@pytest.mark.parametrize("attention", ["full", "sliding", "block64", "padded"])
@pytest.mark.parametrize("lengths", [[0, 0, 0], [0, 5, 0]])
def test_batch_of_empty_histories_trains(tiny_meta, batch_factory, attention, lengths,
                                         shared_qk):
    torch.manual_seed(0)
    model = GemModel(ModelConfig(d_model=16, num_heads=2, seq_layers=2, attention=attention,
                                 expert_hidden=32, head_hidden=32, shared_qk=shared_qk),
                     tiny_meta)
    batch = batch_factory(tiny_meta, lengths)
    logits = model(batch)
    assert logits.shape == (len(lengths), 2)
    assert torch.isfinite(logits).all()
    loss, _ = compute_loss(logits, batch)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
