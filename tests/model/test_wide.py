"""The wide (first-order) terms: a wide model starts as the deep network alone, its wide
weights are tables (trained by the table optimizer, not the dense one), and they learn a per-id
effect that the logits then carry."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gem_platform.model import GemModel
from gem_platform.recipe import ModelConfig

LENGTHS = [1, 5, 0, 70, 2]


def test_a_wide_model_starts_as_the_deep_network_alone(tiny_meta, batch_factory):
    """Same seed, same batch: the same logits with and without the wide terms (their weights
    start at zero), and every wide table is a table the table optimizer trains."""
    batch = batch_factory(tiny_meta, LENGTHS)
    torch.manual_seed(0)
    deep = GemModel(ModelConfig(d_model=16, num_heads=2), tiny_meta)
    torch.manual_seed(0)
    wide = GemModel(ModelConfig(d_model=16, num_heads=2, wide=True), tiny_meta)
    logits = wide(batch)
    assert torch.equal(deep(batch), logits)
    logits.sum().backward()
    tables = {id(p) for p in wide.embedding_parameters()}
    wide_tables = list(wide.wide_embeddings.parameters())
    # one per sparse feature and the candidate item (this meta's items carry no category)
    assert len(wide_tables) == len(tiny_meta.sparse_features) + 1
    assert all(id(p) in tables for p in wide_tables)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in wide_tables)
    assert not tables & {id(p) for p in wide.wide_dense.parameters()}


def test_wide_weights_learn_a_per_user_effect(tiny_meta, batch_factory):
    """Clicks that depend on the user alone (planted effects from -2 to 2): the wide tables,
    trained as a recipe trains its tables (Adagrad, the demo's rate and accumulator start),
    line up with the planted effects, and the model's CTR logit follows them."""
    g = torch.Generator().manual_seed(0)
    effect = torch.linspace(-2, 2, 20)[torch.randperm(20, generator=g)]
    torch.manual_seed(0)
    model = GemModel(ModelConfig(d_model=16, num_heads=2, wide=True), tiny_meta)
    opt = torch.optim.Adagrad(model.wide_embeddings.parameters(), lr=4.0,
                              initial_accumulator_value=1e-3)
    for step in range(150):
        batch = batch_factory(tiny_meta, [3] * 64, seed=step)
        clicks = torch.bernoulli(torch.sigmoid(effect[batch.sparse["user_id"].values()]),
                                 generator=g)
        loss = F.binary_cross_entropy_with_logits(model(batch)[:, 0], clicks)
        opt.zero_grad()
        loss.backward()
        opt.step()
    learned = model.wide_embeddings.embedding_bags["wide_user_id"].weight[:, 0].detach()
    assert torch.corrcoef(torch.stack([learned, effect]))[0, 1] > 0.9
    batch = batch_factory(tiny_meta, [3] * 256, seed=999)
    with torch.no_grad():
        ctr = model(batch)[:, 0]
    planted = effect[batch.sparse["user_id"].values()]
    assert torch.corrcoef(torch.stack([ctr, planted]))[0, 1] > 0.9


def test_the_wide_dense_term_weighs_products_of_dense_features():
    """A label logit that is the product of two dense features is one weight away for the wide
    dense term (a linear fit cannot reach it); past MAX_PAIRED_DENSE features it is linear."""
    from gem_platform.model.wide import MAX_PAIRED_DENSE, WideDense

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 3, generator=g)
    target = (x[:, 0] * x[:, 2])[:, None].expand(-1, 2)
    term = WideDense(3)
    assert torch.equal(term(x), torch.zeros(4096, 2))
    opt = torch.optim.Adam(term.parameters(), lr=0.05)
    for _ in range(300):
        loss = F.mse_loss(term(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 1e-3
    assert WideDense(MAX_PAIRED_DENSE + 1).linear.in_features == MAX_PAIRED_DENSE + 1
