"""The off-the-shelf attention (model.kernel=baseline, gem_bench's model variant) computes what
the platform's ops do: self-attention (full, causal, sliding, 64-token blocks with RoPE) and
padded GDPA, on jagged inputs with empty and one-token sequences; the whole model trains with
it. The variant is found by name through its entry point in a process that never imported
gem_bench, and an unknown name is refused with the installed ones named."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest
import tomllib
import torch
from pydantic import ValidationError

from gem_bench import baseline
from gem_kernels.block_attention import RopeConfig, block_attention
from gem_kernels.gdpa import gdpa
from gem_kernels.jagged_attention import jagged_attention
from gem_platform import model_variants
from gem_platform.errors import GemError
from gem_platform.model import GemModel
from gem_platform.recipe import ModelConfig
from tests.conftest import REPO

LENGTHS = [5, 0, 130, 1, 64]


def _qkv(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return (*(torch.randn(t, 2, 16, generator=g) for _ in range(3)), offsets)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (8, 0)),
                                            (False, (4, 4))])
def test_self_attention_matches_jagged_attention(causal, window):
    q, k, v, offsets = _qkv(LENGTHS)
    want = jagged_attention(q, k, v, offsets, max(LENGTHS), causal=causal, window=window,
                            kernel="pytorch")
    got = baseline.self_attention(q, k, v, offsets, max(LENGTHS), causal, window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rope", [None, 10000.0])
def test_block_attention_matches(rope):
    q, k, v, offsets = _qkv(LENGTHS, seed=1)
    blocks, longest = baseline.block_offsets(offsets)
    assert longest == 64 and blocks.tolist() == [0, 5, 69, 133, 135, 136, 200]
    want = block_attention(q, k, v, offsets, block=64,
                           rope=None if rope is None else RopeConfig(base=rope),
                           kernel="pytorch")
    got = baseline.block_attention(q, k, v, offsets, rope, causal=False)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_padded_gdpa_matches():
    q, k, v, offsets = _qkv(LENGTHS, seed=2)
    kv_off = torch.arange(len(LENGTHS) + 1) * 3
    kk, vv = k[: 3 * len(LENGTHS)], v[: 3 * len(LENGTHS)]
    want = gdpa(q, kk, vv, offsets, kv_off, max(LENGTHS), 3, activation="silu",
                norm="kv_len", kernel="pytorch")
    got = baseline.gdpa(q, kk, vv, offsets, kv_off, max(LENGTHS), 3, activation="silu",
                        norm="kv_len")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ["full", "block64"])
def test_model_with_baseline_parts_equals_reference_model(attention, tiny_meta, batch_factory):
    cfg = dict(d_model=16, num_heads=2, attention=attention, rope=attention == "block64",
               pooled_queries=2)
    torch.manual_seed(0)
    ours = GemModel(ModelConfig(**cfg, kernel="pytorch"), tiny_meta)
    torch.manual_seed(0)
    off_the_shelf = GemModel(ModelConfig(**cfg, kernel="baseline"), tiny_meta)
    batch = batch_factory(tiny_meta, [4, 70, 1])
    want, got = ours(batch), off_the_shelf(batch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    got.sum().backward()
    assert all(p.grad is not None for p in off_the_shelf.sequence.parameters())


def test_pyproject_declares_the_variant_and_it_loads():
    tree = tomllib.loads((REPO / "pyproject.toml").read_text())
    value = tree["project"]["entry-points"][model_variants.GROUP]["baseline"]
    assert EntryPoint("baseline", value, model_variants.GROUP).load() is baseline.VARIANT


def test_unknown_kernel_is_refused_naming_the_installed_variants():
    with pytest.raises(ValidationError) as err:
        ModelConfig(kernel="flash9")
    text = str(err.value)
    assert "'flash9'" in text and "auto, triton, pytorch" in text and "baseline" in text
    with pytest.raises(GemError, match="'flash9'.*installed model variant"):
        model_variants.get("flash9")


def test_a_fresh_process_finds_the_variant_through_its_entry_point():
    """As a Ray worker does (tests/cli/test_submit_cli.py trains the variant on two): gem_bench
    is never imported by name, yet model.kernel=baseline validates and the model computes with
    gem_bench's parts."""
    code = ("import sys; from gem_platform.recipe import ModelConfig; "
            "from gem_platform import model_variants as m; "
            "ModelConfig(kernel='baseline'); v = m.get('baseline'); "
            "assert 'gem_bench' in type(v).__module__, type(v); print(m.installed())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "baseline" in proc.stdout
