"""GDPA without host syncs: with the offsets' host copies remembered (gem_kernels.host_offsets),
a forward + backward on new offsets (so every schedule is built, none cached) runs under
``torch.cuda.set_sync_debug_mode("error")``, and gives what a run without remembered offsets
(which reads them back from the device) gives. The model side too: a batch moved by
JaggedBatch.to or the prefetcher's copy, through CrossAttention and PooledAttention.

Each case first runs once unchecked: Triton compiles, and the backward tuner times its
candidates, on a shape's first call (both may sync)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gem_kernels import host_to_device
from gem_kernels.gdpa import gdpa
from gem_kernels.testing import lognormal_lengths, offsets_from_lengths

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

B, H, D = 64, 8, 128
HIST = lognormal_lengths(B, 400, 2048, seed=11)
SHAPES = {"cross": (HIST, [16] * B),    # long Q (history), short KV (context tokens)
          "pooled": ([4] * B, HIST),    # short Q (pooled queries), long KV (history)
          "long": (HIST, HIST)}         # both long: the tuned one-pass backward


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _offsets(lengths: list[int], remember: bool) -> torch.Tensor:
    """New device offsets (new objects: the schedule cache misses), remembered or not."""
    host = offsets_from_lengths(lengths)
    return host_to_device(host, "cuda", remember=True) if remember else host.to("cuda")


def _step(qkv, do, ql, kl, remember: bool, deterministic: bool):
    leaves = [t.detach().requires_grad_(True) for t in qkv]
    qo, ko = _offsets(ql, remember), _offsets(kl, remember)
    with no_sync() if remember else contextlib.nullcontext():
        out = gdpa(*leaves, qo, ko, max(ql), max(kl), activation="silu", norm="kv_len",
                   kernel="triton", deterministic=deterministic)
        out.backward(do)
    return out.detach(), *(t.grad for t in leaves)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gdpa_forward_backward_never_syncs_with_remembered_offsets(shape, deterministic):
    ql, kl = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(n, H, D, generator=g).to("cuda", torch.bfloat16)
           for n in (sum(ql), sum(kl), sum(kl))]
    do = torch.randn(sum(ql), H, D, generator=g).to("cuda", torch.bfloat16)
    plain = _step(qkv, do, ql, kl, remember=False, deterministic=deterministic)  # warm-up
    got = _step(qkv, do, ql, kl, remember=True, deterministic=deterministic)
    again = _step(qkv, do, ql, kl, remember=False, deterministic=deterministic)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[0], again[0])  # forward: exact
    for name, a, b in zip("qkv", got[1:], again[1:], strict=True):
        if deterministic:  # no atomics: bit for bit
            assert torch.equal(a, b), name
        else:  # fp32 atomics sum in any order: equal up to rounding
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_model_attention_on_a_moved_batch_never_syncs():
    """seq_offsets moved by JaggedBatch.to and by the prefetcher's copy are known on the host;
    CrossAttention and PooledAttention build theirs on the host."""
    KeyedJaggedTensor = pytest.importorskip("torchrec").KeyedJaggedTensor

    from gem_platform.data.batch import JaggedBatch
    from gem_platform.model.interaction import CrossAttention, PooledAttention
    from gem_platform.train.prefetch import pin, to_device

    dim, n_ctx, t = H * D, 4, sum(HIST)
    ids = torch.ones(t, dtype=torch.int64)
    host = JaggedBatch(offsets_from_lengths(HIST), ids, ids, torch.zeros(t), ids[:B],
                       KeyedJaggedTensor.from_lengths_sync(["f"], ids[:B], ids[:B]),
                       torch.zeros(B, 1), torch.zeros(B, 2))
    cross = CrossAttention(dim, H, "silu", "auto").cuda().bfloat16()
    pooled = PooledAttention(dim, H, 4, "silu", "auto").cuda().bfloat16()
    x = torch.randn(t, dim, device="cuda", dtype=torch.bfloat16)
    ctx = torch.randn(B, n_ctx, dim, device="cuda", dtype=torch.bfloat16)
    ad = torch.randn(B, dim, device="cuda", dtype=torch.bfloat16)

    def step(batch: JaggedBatch) -> None:
        h = cross(x, batch.seq_offsets, max(HIST), ctx)
        pooled(h, batch.seq_offsets, max(HIST), ad).float().sum().backward()

    step(host.to("cuda"))  # warm-up
    for moved in (host.to("cuda"), to_device(pin(host), torch.device("cuda"), max(HIST))):
        torch.cuda.current_stream().synchronize()
        with no_sync():
            step(moved)
