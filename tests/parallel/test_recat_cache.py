"""TorchRec's all-to-all permutation index is built once per layout, not once per batch (on a
GPU each build is a host sync), and is the index TorchRec would have built."""

from __future__ import annotations

import torch
from torchrec.distributed import dist_data

from gem_platform.parallel.recat_cache import cached_recat, install


def test_one_tensor_per_layout_equal_to_torchrecs():
    built: list[tuple] = []

    def build(local_split, num_splits, stagger=1, device=None, batch_size_per_rank=None):
        built.append((local_split, num_splits, stagger, batch_size_per_rank))
        return torch.arange(local_split * num_splits)

    get = cached_recat(build)
    a = get(2, 4, 1, torch.device("cpu"), [8, 8, 8, 8])
    b = get(local_split=2, num_splits=4, stagger=1, device=torch.device("cpu"),
            batch_size_per_rank=[8, 8, 8, 8])
    assert a is b and len(built) == 1
    c = get(2, 4, 1, torch.device("cpu"), [8, 8, 8, 7])  # another layout: built anew
    assert c is not a and built[-1] == (2, 4, 1, [8, 8, 8, 7])


def test_installed_builder_matches_torchrec_and_is_installed_once():
    original = dist_data._get_recat
    try:
        install()
        cached = dist_data._get_recat
        install()
        assert dist_data._get_recat is cached  # idempotent: not wrapped twice
        for args in [(2, 4, 1), (2, 4, 2), (1, 1, 1)]:
            want = (original.__wrapped__ if hasattr(original, "cached_by_gem") else original)(
                *args, device=torch.device("cpu"))
            got = cached(*args, device=torch.device("cpu"))
            assert torch.equal(got, want)
            assert cached(*args, device=torch.device("cpu")) is got
        assert cached(0, 4, 1, device=torch.device("cpu")) is None  # an empty local split
    finally:
        dist_data._get_recat = original
