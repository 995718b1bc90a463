"""train.saved_activations: fp8 keeps the bf16 activations saved for the backward in 8 bits
(one fp32 scale per 128 elements) and leaves what must stay exact alone; eager, recomputed and
compiled regions train with it, and a tiny recipe trains end to end."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gem_platform.errors import RecipeError
from gem_platform.model import GemModel
from gem_platform.recipe import ModelConfig, recipe_from_dict
from gem_platform.train.regions import apply_regions, measure_cost, model_regions
from gem_platform.train.saved_activations import (
    BLOCK,
    MIN_ELEMENTS,
    Fp8SavedTensors,
    Fp8Tensor,
    compressible,
    stored_bytes,
    weight_shapes,
)
from tests.tiny_training import tiny_tree as tiny_tree_at
from tests.tiny_training import train_losses


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    """Each element's block maximum (blocks of BLOCK consecutive row-major elements)."""
    flat = x.float().reshape(-1)
    padded = F.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)
    amax = padded.abs().amax(1, keepdim=True).expand_as(padded)
    return amax.reshape(-1)[: flat.numel()].view(x.shape)


def test_round_trip_is_close_keeps_zeros_and_geometry():
    g = torch.Generator().manual_seed(0)
    rows = torch.logspace(-4, 4, 96)[:, None]  # rows 8 orders of magnitude apart
    x = (torch.randn(96, 201, generator=g) * rows).to(torch.bfloat16)  # a partial last block
    x[5] = 0
    x[7, ::3] = 0
    hooks = Fp8SavedTensors()
    packed = hooks.pack(x)
    assert isinstance(packed, Fp8Tensor) and packed.data.dtype == torch.float8_e4m3fn
    assert packed.nbytes < x.numel() * x.element_size() * 0.52  # 1 byte + 4/128 per element
    back = hooks.unpack(packed)
    assert back.dtype == x.dtype and back.shape == x.shape and back.stride() == x.stride()
    err = (back.float() - x.float()).abs()
    # e4m3 keeps 3 mantissa bits: 2^-4 of the element (bf16 rounding on top), or 2^-10 of the
    # block's scale (amax / 448) below e4m3's normal range
    bound = x.float().abs() * (2**-4 + 2**-8) + _block_amax(x) / 448 * 2**-10
    assert (err <= bound).all(), float((err - bound).max())
    assert (back[x == 0] == 0).all() and (back[5] == 0).all()
    assert torch.equal(_block_amax(back), _block_amax(x))  # each block's largest is exact

    # views come back with their strides: a transpose (dense) and q of a fused qkv (strided)
    qkv = torch.randn(300, 3, 2, 32, generator=g).to(torch.bfloat16)
    for view in (x.t(), qkv.unbind(1)[0]):
        back = hooks.unpack(hooks.pack(view))
        assert back.stride() == view.stride() and back.shape == view.shape
        torch.testing.assert_close(back, view, rtol=2**-4 + 2**-8, atol=1e-3)


def test_what_must_stay_exact_passes_through_untouched():
    hooks = Fp8SavedTensors()
    keep = {
        "fp32 (statistics: log-sum-exp, norm rstd, FP8 scales)": torch.randn(64, 128),
        "int64 offsets": torch.arange(MIN_ELEMENTS * 2),
        "bool mask": torch.ones(64, 128, dtype=torch.bool),
        "tiny": torch.randn(MIN_ELEMENTS - 1, dtype=torch.bfloat16),
        "parameter": nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16)),
        "already 8-bit": torch.randn(64, 128).to(torch.float8_e4m3fn),
        "broadcast view": torch.randn(1, 128, dtype=torch.bfloat16).expand(64, 128),
        "narrow slice of a wide buffer": torch.randn(64, 4096, dtype=torch.bfloat16)[:, :128],
    }
    for what, t in keep.items():
        assert not compressible(t), what
        assert hooks.pack(t) is t, what
        assert hooks.unpack(t) is t, what
    assert hooks.tensors == 0

    # autocast's bf16 copy of a weight (shaped like a parameter) is a weight: only the two
    # activations are stored in 8 bits
    lin = nn.Linear(128, 256)
    x = torch.randn(512, 128, requires_grad=True)
    with Fp8SavedTensors(lin) as hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.gelu(lin(x))
    assert hooks.tensors == 2 and hooks.original_bytes == 512 * (128 + 256) * 2
    y.float().sum().backward()


def _grads_and_saved_bytes(model: nn.Module, inputs: tuple, compress: bool, device: str = "cpu"
                           ) -> tuple[dict[str, torch.Tensor], int, list[torch.Size]]:
    """Parameter gradients of one bf16-autocast forward and backward, the bytes its saved
    tensors hold (each storage or 8-bit copy once) and the shapes stored in 8 bits."""
    held: dict[tuple, int] = {}
    stored: list[torch.Size] = []
    hooks = Fp8SavedTensors(model)

    def pack(t: torch.Tensor):
        p = hooks.pack(t) if compress else t
        if isinstance(p, Fp8Tensor):
            held[("fp8", id(p))] = p.nbytes
            stored.append(p.shape)
        else:
            held[("tensor", p.untyped_storage().data_ptr())] = p.untyped_storage().nbytes()
        return p

    with torch.autograd.graph.saved_tensors_hooks(pack, hooks.unpack), \
            torch.autocast(device, dtype=torch.bfloat16):
        out = model(*inputs)
    F.binary_cross_entropy_with_logits(out.float(), torch.ones_like(out, dtype=torch.float32)
                                       ).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, sum(held.values()), stored


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def test_mlp_gradients_stay_close_and_saved_bytes_shrink():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 64))
    x = torch.randn(4096, 256)
    plain, plain_bytes, _ = _grads_and_saved_bytes(model, (x,), compress=False)
    fp8, fp8_bytes, stored = _grads_and_saved_bytes(model, (x,), compress=True)
    assert len(stored) == 5  # the three Linear inputs (autocast's bf16 casts), two GELU inputs
    for name in plain:
        assert _cosine(plain[name], fp8[name]) > 0.99, name
    assert plain_bytes / fp8_bytes > 1.7, (plain_bytes, fp8_bytes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["full", "block64"])
@pytest.mark.parametrize("regions", ["eager", "inductor"])
def test_gpu_attention_kernels_train_under_fp8(attention, regions, tiny_meta, batch_factory):
    """On CUDA the Triton attention kernels save their own tensors (jagged attention's fp32
    log-sum-exp stays exact): gradients stay close to bf16's and the saved bytes shrink. The
    farthest parameter gradients are the QK-norm weights' (small sums of cancelling terms): on
    the CPU reference path at these shapes their cosine is 0.92 with full attention, 0.997 with
    block64; the NE cost is for the ablation (recipes/ablations/activations_h200.yaml)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GemModel(ModelConfig(d_model=128, num_heads=2, seq_layers=2, dhen_layers=1,
                                 attention=attention), tiny_meta).cuda()
    if regions == "inductor":
        apply_regions(model_regions(model), compile=True, backend="inductor")
    batch = batch_factory(tiny_meta, [40, 900, 130, 64, 512, 17] * 8).to("cuda")
    plain, plain_bytes, _ = _grads_and_saved_bytes(model, (batch,), False, "cuda")
    fp8, fp8_bytes, stored = _grads_and_saved_bytes(model, (batch,), True, "cuda")
    assert stored and plain_bytes / fp8_bytes > 1.2, (plain_bytes, fp8_bytes)
    every = torch.cat([g.flatten() for g in plain.values()])
    assert _cosine(every, torch.cat([fp8[n].flatten() for n in plain])) > 0.999
    worst = min((_cosine(plain[n], fp8[n]), n) for n in plain if plain[n].norm() > 0)
    assert worst[0] > 0.9, worst


@pytest.mark.parametrize("regions", ["eager", "recompute", "aot_eager", "inductor"])
def test_gem_model_trains_under_fp8_in_every_kind_of_region(regions, tiny_meta, batch_factory):
    """The tiny GemModel under bf16 autocast: gradients close to the uncompressed ones. A
    recomputed region stores nothing in 8 bits (checkpoint's own hooks hold no activation); a
    compiled region's saved tensors are compressed after its forward and come back with the
    strides its compiled backward expects."""
    if regions == "inductor" and not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("inductor on CPU needs a C++ compiler")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GemModel(ModelConfig(d_model=64, num_heads=2, seq_layers=1, dhen_layers=1,
                                 attention="block64"), tiny_meta)
    batch = batch_factory(tiny_meta, [40, 90, 130, 64] * 4)
    if regions == "recompute":
        apply_regions(model_regions(model), compile=False,
                      recompute=[r.name for r in model_regions(model)])
    elif regions != "eager":
        apply_regions(model_regions(model), compile=True, backend=regions)
    plain, plain_bytes, _ = _grads_and_saved_bytes(model, (batch,), compress=False)
    fp8, fp8_bytes, stored = _grads_and_saved_bytes(model, (batch,), compress=True)
    assert stored and fp8_bytes < plain_bytes
    every = torch.cat([g.flatten() for g in plain.values()])
    assert _cosine(every, torch.cat([fp8[n].flatten() for n in plain])) > 0.999
    # per parameter too (the closest calls are small gradients summed from cancelling terms:
    # the pooled-attention query weights, ~0.999 here)
    worst = min(_cosine(plain[n], fp8[n]) for n in plain if plain[n].norm() > 0)
    assert worst > 0.99, worst
    tokens = sum([40, 90, 130, 64] * 4)
    ffn_hidden = torch.Size([tokens, 4 * 64])  # the sequence layer's widest activation
    if regions == "recompute":
        assert ffn_hidden not in stored
    else:
        assert ffn_hidden in stored


@pytest.fixture
def tiny_tree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = tiny_tree_at(tmp_path / "data", steps=8)
    tree["precision"] = {"mode": "bf16"}
    return tree


def _with(tree: dict, **train) -> dict:
    return {**tree, "train": {**tree["train"], **train}}


def test_tiny_recipe_trains_with_fp8_saved_activations(tiny_tree):
    plain, _ = train_losses(tiny_tree)
    fp8, summary = train_losses(_with(tiny_tree, saved_activations="fp8"))
    assert len(fp8) == 8 and all(math.isfinite(v) for v in fp8)
    assert fp8[0] == pytest.approx(plain[0], rel=1e-6)  # the forward is untouched
    assert fp8 != plain  # the backward read 8-bit activations
    assert fp8 == pytest.approx(plain, rel=0.02), (plain, fp8)  # and training follows bf16's
    assert math.isfinite(summary["eval/ne_ctr"])

    with pytest.raises(RecipeError, match="train.saved_activations"):
        recipe_from_dict(_with(tiny_tree, saved_activations="fp4"))
    assert recipe_from_dict(tiny_tree).train.saved_activations == "bf16"
    fp32 = {**_with(tiny_tree, saved_activations="fp8"), "precision": {"mode": "fp32"}}
    with pytest.raises(RecipeError, match="precision.mode=fp32"):
        recipe_from_dict(fp32)  # refused when the recipe is read, before any data or model


def test_the_activation_budget_counts_fp8_saved_tensors_at_their_stored_size(tiny_meta):
    model = GemModel(ModelConfig(d_model=64, num_heads=2, seq_layers=1, dhen_layers=1,
                                 attention="full"), tiny_meta)
    weights = weight_shapes(model.parameters())
    for region in model_regions(model):
        def cost(stored, region=region):
            return measure_cost(model, region, torch.device("cpu"),
                                lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                                units=512, stored=stored).saved_bytes

        plain, fp8 = cost(None), cost(lambda t: stored_bytes(t, weights))
        assert fp8 < plain, region.name  # bf16 activations at one byte and a scale per 128
        assert plain / fp8 <= 2.0, region.name
