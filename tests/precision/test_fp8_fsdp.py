"""FP8 weight all-gather under FSDP2: 2 real processes on gloo (CPU), compared with the ordinary
high-precision all-gather of the same model."""

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(),
                         nn.Linear(64, 8))


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.fsdp import fully_shard

        from gem_platform.precision import (
            Fp8AllGatherWeight,
            convert_to_fp8,
            enable_fp8_all_gather,
        )

        torch.manual_seed(1)  # same data on every rank
        x = torch.randn(32, 64)
        results = {}
        for fp8_gather in (False, True):
            model = _mlp()
            converted = convert_to_fp8(model, block=32, hadamard=True, hadamard_block=32,
                                       stochastic_rounding=False, wgrad="bf16", keep_last=0,
                                       keep=[])
            gathered = enable_fp8_all_gather(model, WORLD) if fp8_gather else []
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
            Fp8AllGatherWeight.last_all_gather_dtypes = ()
            y = model(x)
            y.sum().backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            results[fp8_gather] = {"y": y.detach(), "converted": converted,
                                   "gathered": gathered, "grads": grads,
                                   "wire": Fp8AllGatherWeight.last_all_gather_dtypes}
            # a second step re-gathers into the same buffers (post_all_gather with out=)
            y2 = model(x)
            results[fp8_gather]["y2"] = y2.detach()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fp8_all_gather_matches_high_precision_gather():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(_free_port(), d), nprocs=WORLD, join=True)
        res = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(WORLD)]
    for r in res:
        plain, fp8 = r[False], r[True]
        assert fp8["converted"] == ["0", "2"]  # the last linear (8 outputs) stays bf16 by shape
        assert fp8["gathered"] == ["0", "2"]
        # on the wire: fp8 bytes + fp32 scales, never the bf16/fp32 weight
        assert fp8["wire"] == (torch.float8_e4m3fn, torch.float32)
        assert plain["wire"] == ()
        # both paths quantize the same weight the same way: FP8 gather == gather then quantize
        assert torch.allclose(fp8["y"], plain["y"], rtol=1e-5, atol=1e-6)
        assert torch.allclose(fp8["y2"], fp8["y"])
        # and within FP8 tolerance of the exact model
        with torch.no_grad():
            exact = _mlp()(torch.manual_seed(1) and torch.randn(32, 64))
        rel = (fp8["y"] - exact).norm() / exact.norm()
        assert rel < 0.05
        for name, g in plain["grads"].items():
            assert torch.allclose(fp8["grads"][name], g, rtol=1e-4, atol=1e-6), name
    assert torch.equal(res[0][True]["y"], res[1][True]["y"])


def test_convert_keeps_last_and_named_layers():
    from gem_kernels.fp8 import Fp8BlockLinear
    from gem_platform.precision import convert_to_fp8

    model = nn.ModuleDict({
        "tower": nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)),
        "gate": nn.Linear(64, 64),
        "odd": nn.Linear(48, 64),  # in_features not a multiple of 32: stays bf16
        "head": nn.Linear(64, 1),
    })
    w0 = model["tower"][0].weight
    names = convert_to_fp8(model, block=32, hadamard=True, hadamard_block=64,
                           stochastic_rounding=True, wgrad="bf16", keep_last=1, keep=["gate"])
    # keep_last counts FP8-capable layers: "head" (1 output) and "odd" stay bf16 by shape, so
    # the last layer that would run in FP8, tower.2, is the one kept
    assert names == ["tower.0"]
    assert isinstance(model["tower"][0], Fp8BlockLinear)
    assert model["tower"][0].weight is w0  # parameters shared: optimizer state survives
    assert model["tower"][0].cfg.stochastic_rounding and model["tower"][0].cfg.hadamard
    for kept in ("gate", "odd", "head"):
        assert type(model[kept]) is nn.Linear
    assert type(model["tower"][2]) is nn.Linear
    assert convert_to_fp8(model, block=32, hadamard=False, hadamard_block=128,
                          stochastic_rounding=False, wgrad="bf16", keep_last=0,
                          keep=["tower.*", "odd"]) == ["gate"]  # head: 1 output, too narrow


def test_conversion_skips_layers_narrower_than_min_features():
    """min_features keeps narrow layers bf16, by the narrower side of each layer, and
    keep_last then counts only the layers left."""
    from gem_platform.precision import convert_to_fp8

    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 128),
                          nn.Linear(256, 256))
    names = convert_to_fp8(model, block=32, keep_last=1, min_features=256)
    assert names == ["1"]  # 0 (64 in) and 2 (128 out) too narrow; 3 kept as the last capable
    assert [type(m) is nn.Linear for m in model] == [True, False, True, True]
    assert convert_to_fp8(nn.Sequential(nn.Linear(64, 64)), block=32, keep_last=0,
                          min_features=0) == ["0"]
