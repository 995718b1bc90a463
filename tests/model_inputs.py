"""Small jagged batches and dataset metas built by hand, for model-block tests; the tiny
checkpointing recipe the checkpoint tests share. The test folders that use them import these
fixtures in their conftest.py."""

from __future__ import annotations

import pytest
import torch
import yaml
from torchrec import KeyedJaggedTensor

from gem_platform.data.batch import JaggedBatch
from gem_platform.data.meta import DatasetMeta, SparseFeatureSpec
from tests.tiny_training import TINY


@pytest.fixture
def tiny_meta() -> DatasetMeta:
    return DatasetMeta(
        source="synthetic", num_items=50, num_action_types=3,
        sparse_features=[SparseFeatureSpec("user_id", 20), SparseFeatureSpec("genre", 7, True)],
        dense_dim=3, num_train=0, num_eval=0, ctr_base_rate=0.2, cvr_base_rate=0.3,
    )


def make_batch(meta: DatasetMeta, lengths: list[int], seed: int = 0) -> JaggedBatch:
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), sum(lengths)
    offsets = torch.zeros(b + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    genre_len = torch.randint(0, 3, (b,), generator=g)
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["user_id", "genre"],
        values=torch.cat([torch.randint(0, 20, (b,), generator=g),
                          torch.randint(0, 7, (int(genre_len.sum()),), generator=g)]),
        lengths=torch.cat([torch.ones(b, dtype=torch.int64), genre_len]),
    )
    clicks = torch.randint(0, 2, (b,), generator=g).float()
    return JaggedBatch(
        seq_offsets=offsets,
        seq_item_ids=torch.randint(1, meta.num_items + 1, (t,), generator=g),
        seq_action_types=torch.randint(0, meta.num_action_types, (t,), generator=g),
        seq_age=torch.rand(t, generator=g) * 10,
        ad_item_id=torch.randint(1, meta.num_items + 1, (b,), generator=g),
        sparse=sparse,
        dense=torch.randn(b, meta.dense_dim, generator=g),
        labels=torch.stack([clicks, clicks * torch.randint(0, 2, (b,), generator=g)], 1),
    )


@pytest.fixture
def batch_factory():
    return make_batch


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory):
    """(folder, recipe tree): TINY on one worker, 6 steps, a checkpoint every 2 (module-wide)."""
    d = tmp_path_factory.mktemp("ckpt")
    tree = yaml.safe_load(TINY.format(data=d / "data"))
    tree["train"].update(steps=6, log_every=1, checkpoint_every=2, keep_checkpoints=2)
    tree["parallel"]["workers"] = 1
    return d, tree
