"""Forward and backward of every model block on jagged input, incl. length-1 and empty
histories, for each attention kind; and FLOP counting on real lengths."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gem_platform.model import GemModel
from gem_platform.model.attention import SelfAttentionSpec, self_attention
from gem_platform.model.flops import FlopMeter, self_attention_pairs
from gem_platform.model.gem import EXACT_RECENCY, RECENCY_BUCKETS, recency_buckets
from gem_platform.model.sequence import SelfAttentionBlock
from gem_platform.recipe import ModelConfig

LENGTHS = [1, 5, 0, 70, 2]


@pytest.mark.parametrize("attention", ["full", "sliding", "block64", "padded"])
def test_model_forward_backward_every_attention(attention, tiny_meta, batch_factory):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, num_heads=2, attention=attention, window=8,
                      rope=attention == "block64", pooled_queries=2, dhen_layers=2)
    model = GemModel(cfg, tiny_meta)
    batch = batch_factory(tiny_meta, LENGTHS)
    logits = model(batch)
    assert logits.shape == (len(LENGTHS), 2)
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_history_changes_prediction(tiny_meta, batch_factory):
    """The sequence tower is wired in: a different history changes the logits."""
    torch.manual_seed(0)
    model = GemModel(ModelConfig(d_model=16, num_heads=2), tiny_meta).eval()
    a = batch_factory(tiny_meta, [6, 6], seed=1)
    b = batch_factory(tiny_meta, [6, 6], seed=1)
    b.seq_item_ids = torch.flip(b.seq_item_ids, [0]) % tiny_meta.num_items + 1
    assert not torch.allclose(model(a), model(b))


@pytest.mark.parametrize("kind", ["full", "sliding", "block64"])
def test_jagged_matches_padded_per_sequence(kind):
    """Each jagged kind equals the same attention computed on each sequence alone."""
    torch.manual_seed(0)
    lengths = [3, 1, 70]
    offsets = torch.tensor([0, 3, 4, 74])
    q, k, v = (torch.randn(74, 2, 8) for _ in range(3))
    spec = SelfAttentionSpec(kind=kind, window=4, causal=False)
    out = self_attention(q, k, v, offsets, max(lengths), spec)
    for i, n in enumerate(lengths):
        s, e = int(offsets[i]), int(offsets[i + 1])
        qi, ki, vi = (x[s:e].transpose(0, 1) for x in (q, k, v))
        scores = qi @ ki.transpose(1, 2) / 8**0.5
        pos = torch.arange(n)
        if kind == "sliding":
            allowed = (pos[None, :] - pos[:, None]).abs() <= 4
        elif kind == "block64":
            allowed = (pos[:, None] // 64) == (pos[None, :] // 64)
        else:
            allowed = torch.ones(n, n, dtype=torch.bool)
        ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vi
        torch.testing.assert_close(out[s:e], ref.transpose(0, 1))


def test_attention_pair_counts():
    lengths = torch.tensor([3, 70])
    assert self_attention_pairs(lengths, "full", 0, False) == 9 + 4900
    assert self_attention_pairs(lengths, "full", 0, True) == 6 + 70 * 71 / 2
    assert self_attention_pairs(lengths, "block64", 0, False) == 9 + 64 * 64 + 36
    # causal window 2 over length 3: rows see 1, 2, 3 keys
    assert self_attention_pairs(torch.tensor([3]), "sliding", 2, True) == 6
    # two-sided window 1 over length 3: rows see 2, 3, 2 keys
    assert self_attention_pairs(torch.tensor([3]), "sliding", 1, False) == 7


def test_flop_meter_counts_real_tokens(tiny_meta, batch_factory):
    """Linear FLOPs scale with real tokens: adding history tokens adds exactly their cost."""
    torch.manual_seed(0)
    model = GemModel(ModelConfig(d_model=16, num_heads=2, seq_layers=1), tiny_meta)
    with FlopMeter(model) as short:
        model(batch_factory(tiny_meta, [4, 4]))
    with FlopMeter(model) as long:
        model(batch_factory(tiny_meta, [4, 12]))
    d = 16
    extra_tokens = 8
    # per history token: age proj (1->d), affinity proj (d->d), qkv (d->3d), out (d->d),
    # ffn (d->4d->d), cross q (d->d) and out (d->d), pooled kv (d->2d)
    per_token = 2 * (1 * d + d * d + d * 3 * d + d * d + 2 * d * 4 * d + d * d + d * d
                     + d * 2 * d)
    assert long.linear_flops - short.linear_flops == pytest.approx(extra_tokens * per_token)
    assert long.attention_flops > short.attention_flops > 0
    assert long.train_flops == pytest.approx(3 * long.forward_flops)


def _categorized(meta, batch, k: int):
    """The batch as a dataset whose items carry a category (item id mod k) delivers it."""
    meta = dataclasses.replace(meta, num_categories=k)
    batch = dataclasses.replace(batch, seq_item_categories=batch.seq_item_ids % k,
                    ad_category=batch.ad_item_id % k)
    return meta, batch


def test_item_categories_feed_history_and_candidate(tiny_meta, batch_factory):
    torch.manual_seed(0)
    meta, batch = _categorized(tiny_meta, batch_factory(tiny_meta, LENGTHS), 4)
    model = GemModel(ModelConfig(d_model=16, num_heads=2), meta)
    tables = [c.name for c in model.item_embeddings.embedding_configs()]
    assert tables == ["item", "category"]
    logits = model(batch)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.embedding_parameters())

    # Same items, other categories: the prediction moves.
    other = dataclasses.replace(batch, seq_item_categories=(batch.seq_item_categories + 1) % 4)
    with torch.no_grad():
        assert not torch.allclose(model(batch), model(other))

    with pytest.raises(ValueError, match="carry categories"):
        model(dataclasses.replace(batch, seq_item_categories=None, ad_category=None))


def test_recency_buckets_count_from_the_newest_event():
    offsets = torch.tensor([0, 3, 3, 43])
    owner = torch.repeat_interleave(torch.arange(3), offsets[1:] - offsets[:-1])
    b = recency_buckets(offsets, owner)
    assert b[:3].tolist() == [2, 1, 0]
    last = b[3:].flip(0)  # newest first
    assert last[:EXACT_RECENCY].tolist() == list(range(EXACT_RECENCY))
    assert last[EXACT_RECENCY:32].unique().tolist() == [EXACT_RECENCY]
    assert last[32:].unique().tolist() == [EXACT_RECENCY + 1]
    assert int(b.max()) < RECENCY_BUCKETS


def test_counted_regions_match_per_layer_counting(tiny_meta, batch_factory):
    """Regions counted by one hook (a sequence block by its forward_flops, DHEN layers and the
    head by rows) give the FLOPs that per-Linear hooks give, with or without host lengths."""
    from gem_platform.model.flops import count_by_rows, linear_flops_per_row

    torch.manual_seed(0)
    model = GemModel(ModelConfig(d_model=16, num_heads=2, seq_layers=2), tiny_meta)
    batch = batch_factory(tiny_meta, [4, 9, 0, 30])
    with FlopMeter(model) as plain:
        model(batch)
    for layer in model.dhen:
        count_by_rows(layer)
    count_by_rows(model.head)
    with FlopMeter(model) as regions:
        regions.seq_lengths = batch.seq_lengths.clone()
        model(batch)
    assert regions.linear_flops == pytest.approx(plain.linear_flops)
    assert regions.attention_flops == pytest.approx(plain.attention_flops)
    pairs = self_attention_pairs(batch.seq_lengths, "full", 0, True)
    # two sequence blocks, cross (T x 4 context tokens: ad, dense, 2 sparse), pooled (4 x T)
    t = int(batch.seq_lengths.sum())
    assert plain.attention_flops == pytest.approx(4 * 16 * (2 * pairs + t * 4 + 4 * t))
    assert linear_flops_per_row(model.head) == sum(
        2 * m.in_features * m.out_features for m in model.head if isinstance(m, torch.nn.Linear))


def test_item_lookup_hands_torchrec_each_keys_length(tiny_meta, batch_factory, monkeypatch):
    """The item lookup gives TorchRec each key's total length from the host (the batch's
    token and sample counts), so TorchRec never sums the lengths on the device and reads them
    back: on a GPU that read is a sync every step."""
    import torchrec.sparse.jagged_tensor as jt

    computed: list[list[str]] = []
    original = jt._maybe_compute_length_per_key

    def watch(*args, **kwargs):
        named = dict(zip(("keys", "stride", "stride_per_key", "variable_stride_per_key",
                          "length_per_key"), args, strict=False)) | kwargs
        if named["length_per_key"] is None:
            computed.append(list(named["keys"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(jt, "_maybe_compute_length_per_key", watch)
    model = GemModel(ModelConfig(d_model=16, num_heads=2), tiny_meta)
    batch = batch_factory(tiny_meta, LENGTHS)
    assert batch.num_tokens == sum(LENGTHS)
    model(batch).sum().backward()
    assert not [k for k in computed if "hist_item" in k]


def test_self_gram_matches_bmm_and_its_gradient():
    """The DHEN dot interaction's Gram product: the values and input gradient of
    bmm(t, t^T) (gradcheck in fp64), one contiguous product in the backward; inside autocast
    it computes in autocast's dtype, as bmm would, and hands back a gradient of the input's."""
    from gem_platform.model.interaction import self_gram

    torch.manual_seed(0)
    t = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(self_gram, (t,))
    x = torch.randn(4, 6, 8, requires_grad=True)
    g = torch.randn(4, 6, 6)
    ours = self_gram(x)
    ref = torch.bmm(x, x.transpose(1, 2))
    assert torch.equal(ours, ref)
    (d_ours,) = torch.autograd.grad(ours, x, g)
    (d_ref,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(d_ours, d_ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = self_gram(x)
    assert low.dtype == torch.bfloat16
    (d_low,) = torch.autograd.grad(low, x, g.bfloat16())
    assert d_low.dtype == torch.float32
    torch.testing.assert_close(d_low, d_ref, rtol=0.05, atol=0.05)


def test_dot_interaction_picks_the_pairs_an_index_would():
    """The one-hot product gives exactly the Gram's upper-triangle entries an index gives, and
    exactly the index's gradient, in fp32 and in bf16 autocast."""
    from gem_platform.model.interaction import DotInteraction, self_gram

    torch.manual_seed(0)
    n, d = 7, 8
    layer = DotInteraction(n, 5)
    rows, cols = torch.triu_indices(n, n, offset=1)
    tokens = torch.randn(4, n, d, requires_grad=True)
    for dtype in (torch.float32, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            gram = self_gram(tokens)
            ours = gram.flatten(1) @ layer.pick.to(gram.dtype)
            ref = gram[:, rows, cols]
        g = torch.randn_like(ref)
        assert torch.equal(ours, ref)
        assert torch.equal(*(torch.autograd.grad(y, tokens, g, retain_graph=True)[0]
                             for y in (ours, ref)))
    assert layer(tokens).shape == (4, 5)
    assert "pick" not in layer.state_dict()  # checkpoints carry only the projection


def test_one_hot_embedding_is_a_lookup():
    """Rows exactly as nn.Embedding gives them (also inside bf16 autocast: fp32 out), the same
    weight gradient to rounding, the same state dict; indices of any shape."""
    from gem_platform.model.small_table import OneHotEmbedding

    torch.manual_seed(0)
    ours, ref = OneHotEmbedding(6, 8), torch.nn.Embedding(6, 8)
    ref.load_state_dict(ours.state_dict())
    assert list(ours.state_dict()) == ["weight"]
    idx = torch.randint(0, 6, (3, 50))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(idx)
    assert out.dtype == torch.float32 and torch.equal(out, ref(idx))
    g = torch.randn(3, 50, 8)
    (d_ours,) = torch.autograd.grad(ours(idx), ours.weight, g)
    (d_ref,) = torch.autograd.grad(ref(idx), ref.weight, g)
    torch.testing.assert_close(d_ours, d_ref)


def test_newest_mean_averages_each_samples_last_events_and_zero_for_none():
    from gem_platform.model.gem import newest_mean

    x = torch.arange(16.0).view(8, 2).requires_grad_()  # histories of 3, 0, 1 and 4 events
    offsets = torch.tensor([0, 3, 3, 4, 8])
    torch.testing.assert_close(newest_mean(x, offsets, 1),
                               torch.tensor([[4.0, 5.0], [0.0, 0.0], [6.0, 7.0], [14.0, 15.0]]))
    got = newest_mean(x, offsets, 2)
    torch.testing.assert_close(got, torch.tensor([[3.0, 4.0], [0.0, 0.0], [6.0, 7.0],
                                                  [13.0, 14.0]]))
    got.sum().backward()
    # only the newest two rows of each history get a gradient: 1 / min(length, 2)
    want = torch.tensor([0.0, 0.5, 0.5, 1.0, 0.0, 0.0, 0.5, 0.5])
    torch.testing.assert_close(x.grad, want[:, None].expand(-1, 2))
    torch.testing.assert_close(newest_mean(x[:0], torch.zeros(3, dtype=torch.int64), 4),
                               torch.zeros(2, 2))


def test_newest_token_joins_the_dhen_tokens(tiny_meta, batch_factory):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, num_heads=2, pooled_queries=2, newest_token=True)
    model = GemModel(cfg, tiny_meta)
    assert model.num_dhen_tokens == 2 + 1 + model.num_context
    batch = batch_factory(tiny_meta, LENGTHS)
    logits = model(batch)
    assert logits.shape == (len(LENGTHS), 2) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_newest_attention_joins_the_dhen_tokens(tiny_meta, batch_factory):
    """model.newest_attention: one more DHEN token, the last block's attention output (its
    ``out`` projection, before the residual add) at each history's newest event; zeros for an
    empty history; trained through."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, num_heads=2, pooled_queries=2, seq_layers=2,
                      newest_attention=True)
    model = GemModel(cfg, tiny_meta)
    assert model.num_dhen_tokens == 2 + 1 + model.num_context
    seen: list[torch.Tensor] = []
    model.sequence.blocks[-1].out.register_forward_hook(lambda *a: seen.append(a[2]))
    dhen_in: list[torch.Tensor] = []
    model.dhen[0].register_forward_pre_hook(lambda m, a: dhen_in.append(a[0]))
    batch = batch_factory(tiny_meta, LENGTHS)
    logits = model(batch)
    newest = torch.tensor(LENGTHS).cumsum(0) - 1
    read = dhen_in[0][:, cfg.pooled_queries]
    want = seen[0][newest] * (torch.tensor(LENGTHS) > 0)[:, None]
    torch.testing.assert_close(read, want)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="newest_attention"):
        ModelConfig(seq_layers=0, newest_attention=True)


@pytest.mark.parametrize("attention", ["full", "block64"])
def test_category_queries_and_keys_find_events_by_their_category(attention, tiny_meta,
                                                                 batch_factory):
    """model.attention_qk=category: queries and keys from each event's category row, values
    from its whole token. Changing only the events' items (categories kept) leaves the
    attention pattern alone and changes the output through the values; the model trains."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, num_heads=2, seq_layers=2, attention=attention,
                      rope=attention == "block64", attention_qk="category")
    meta, a = _categorized(tiny_meta, batch_factory(tiny_meta, LENGTHS, seed=3), 4)
    model = GemModel(cfg, meta)
    block = model.sequence.blocks[0]
    assert block.side_qk and not hasattr(block, "qkv")
    patterns: list[torch.Tensor] = []
    block.qk.register_forward_hook(lambda *a: patterns.append(a[2]))
    # other items, the same categories
    b = dataclasses.replace(a, seq_item_ids=a.seq_item_ids % tiny_meta.num_items + 1)
    with torch.no_grad():
        out_a, out_b = model(a), model(b)
    torch.testing.assert_close(patterns[0], patterns[1], rtol=0, atol=0)
    assert not torch.allclose(out_a, out_b)
    logits = model(a)
    logits.sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    with pytest.raises(ValueError, match="planted"):
        ModelConfig(attention_qk="category", item_vectors="planted")
    with pytest.raises(ValueError, match="categories"):
        GemModel(cfg, tiny_meta)  # its items carry no category


@pytest.mark.parametrize("side_qk", [False, True])
def test_shared_queries_and_keys_rank_an_events_own_kind_first_from_the_start(side_qk):
    """model.shared_qk: one projection gives queries and keys, so before any training every
    event scores highest against the events whose query/key input equals its own (with
    model.attention_qk=category: its category's events)."""
    torch.manual_seed(0)
    spec = SelfAttentionSpec(kind="full", window=64, causal=True)
    block = SelfAttentionBlock(16, 2, spec, qk_norm=True, side_qk=side_qk, shared_qk=True)
    projection = block.qk if side_qk else block.qkv
    assert projection.out_features == (16 if side_qk else 32)  # no separate key projection
    kinds = torch.randn(4, 16)
    kind = torch.arange(24) % 4
    rows = kinds[kind]
    x = torch.randn(24, 16) if side_qk else rows
    q, k, _ = block._qkv(x, rows if side_qk else None)
    scores = torch.einsum("thd,shd->hts", block.q_norm(q), block.k_norm(k))
    same = kind[:, None] == kind[None, :]
    best_other = scores.masked_fill(same, -torch.inf).amax(-1)
    assert (scores.masked_fill(~same, torch.inf).amin(-1) > best_other + 1).all()


def test_recent_mean_joins_the_dhen_tokens(tiny_meta, batch_factory):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, num_heads=2, pooled_queries=2, newest_token=True,
                      recent_mean=4)
    model = GemModel(cfg, tiny_meta)
    assert model.num_dhen_tokens == 2 + 1 + 1 + model.num_context
    batch = batch_factory(tiny_meta, LENGTHS)
    logits = model(batch)
    assert logits.shape == (len(LENGTHS), 2) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
