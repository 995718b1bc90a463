"""train.deterministic on CUDA: a small recipe through the Triton attention kernels (head dim
64) and bf16 autocast, trained twice in one process, gives bitwise-identical step losses and
final metrics: with compiled regions (the CUDA default) and eager, with the tables TorchRec's
fused path trains (where fbgemm-gpu's CUDA build runs) and with plain tables.
Needs only torch, triton, TorchRec and pydantic (no Ray, no MLflow)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _tree(data: str, attention: str) -> dict:
    return {
        "name": "determinism-gpu",
        "model": {"d_model": 128, "num_heads": 2, "seq_layers": 2, "attention": attention,
                  "pooled_queries": 4, "dhen_layers": 1, "expert_hidden": 256,
                  "head_hidden": 128},
        "data": {"source": "synthetic", "path": data,
                 "synthetic": {"num_samples": 6000, "num_users": 500, "num_items": 2000,
                               "seq_len": {"dist": "lognormal", "mean": 200, "min": 1,
                                           "max": 1024}}},
        "loader": {"batching": "bbs", "local_batch_size": 256, "base_batch_size": 64},
        "train": {"steps": 12, "log_every": 1, "warmup_steps": 2, "device": "cuda",
                  "deterministic": True, "seed": 1, "eval_max_samples": 1024},
        "parallel": {"workers": 1, "use_gpu": True},
        "precision": {"mode": "bf16"},
    }


@pytest.mark.parametrize(("attention", "compiled", "tables"), [
    ("full", True, "default"), ("block64", True, "default"), ("full", False, "default"),
    ("full", True, "plain"),
    ("block64_rope", None, "default")])  # compiled by default (Inductor, regions.py)
def test_two_deterministic_gpu_runs_are_bitwise_identical(tmp_path, monkeypatch, attention,
                                                          compiled, tables):
    from gem_platform.parallel.single import plain_tables

    monkeypatch.chdir(tmp_path)
    tree = _tree(str(tmp_path / "data"), attention.removesuffix("_rope"))
    tree["model"]["rope"] = attention.endswith("_rope")
    tree["train"]["compile"] = compiled
    recipe = recipe_from_dict(tree)
    table_mode = plain_tables if tables == "plain" else contextlib.nullcontext

    def run() -> tuple[list[tuple[int, float]], dict]:
        losses: list[tuple[int, float]] = []
        with table_mode():
            summary = train(recipe, echo=lambda _: None,
                            sink=lambda m, s: losses.append((s, m["train/loss"]))
                            if "train/loss" in m else None)
        kept = {k: v for k, v in summary.items()
                if not k.startswith("perf/") and k != "peak_source"}
        return losses, kept

    first_losses, first = run()
    second_losses, second = run()
    assert len(first_losses) == 12
    assert first_losses == second_losses
    assert first == second
    assert first["train/deterministic"] == 1.0


_FRESH = """
import os, sys, torch
from gem_platform.train.determinism import CUBLAS_ENV, deterministic_mode
if sys.argv[1] == "matmul_first":
    x = torch.ones(4, 4, device="cuda")
    x @ x
with deterministic_mode(0, torch.device("cuda")):
    unset = CUBLAS_ENV not in os.environ
    a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    same = torch.equal(a @ b, a @ b)
print("unset" if unset else "set", "same" if same else "differ")
"""


@pytest.mark.parametrize("first", ["nothing", "matmul_first"])
def test_cublas_variable_unset_once_torch_checked_it(first):
    """A fresh process: the mode sets CUBLAS_WORKSPACE_CONFIG, makes torch check it, then unsets
    it (torch parses it at every cuBLAS call while set), and deterministic matmuls still run;
    also after a plain CUDA matmul (torch checks at its first deterministic cuBLAS call)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run([sys.executable, "-c", _FRESH, first], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out == "unset same\n", out
