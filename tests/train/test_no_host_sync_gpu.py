"""The training loop never makes the host wait for the GPU in a steady step (CUDA): with
``torch.cuda.set_sync_debug_mode("warn")`` on from the warm-up's end, every synchronizing call
(``.item()``, ``.tolist()``, a copy to pageable host memory, ``torch.cuda.synchronize``) in the
forward, backward, clipping, optimizer step or read-back is recorded with its Python stack, and
the test lists every such site, not only the first. Compiled and eager regions, full and
block64 attention, and a deterministic run (its deterministic algorithms must not sync
either). Needs only torch, triton, TorchRec and pydantic (no Ray, no MLflow)."""

from __future__ import annotations

import collections
import traceback
import warnings

import pytest
import torch

from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train
from tests.tiny_training import tiny_tree

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _site() -> str:
    """The innermost frames of the current stack outside torch itself, innermost first."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename
              or "torchrec" in f.filename or "fbgemm" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}"
                       for f in reversed(frames[-6:]))


@pytest.mark.parametrize(("attention", "compiled", "deterministic"), [
    ("full", True, False), ("block64", True, False), ("full", False, False),
    ("block64", True, True)])
def test_steady_steps_never_sync_the_host(tmp_path, monkeypatch, attention, compiled,
                                          deterministic):
    monkeypatch.chdir(tmp_path)
    # one progress line at the end only: a logging step reads its values back on purpose
    tree = tiny_tree(tmp_path / "data", steps=12, log_every=12, device="cuda",
                     compile=compiled, eval_max_samples=128, deterministic=deterministic)
    tree["model"]["attention"] = attention
    # head_dim 64 in bf16: every Triton attention kernel runs (block attention takes head_dim 64
    # or 128; smaller heads or fp32 fall back to the PyTorch references, which read lengths on
    # the host)
    tree["model"]["d_model"] = 128
    tree["precision"] = {"mode": "bf16"}
    tree["parallel"]["use_gpu"] = True
    sites: collections.Counter[str] = collections.Counter()
    watched: list[int] = []
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if "synchronizing CUDA operation" in str(message):
            sites[_site()] += 1
        else:
            shown(message, category, filename, lineno, file, line)

    def on_step(step: int, _model: object) -> None:
        if step == 5:
            torch.cuda.set_sync_debug_mode("warn")
        elif step == 10:
            torch.cuda.set_sync_debug_mode(0)
        if 5 < step <= 10:
            watched.append(step)

    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        try:
            train(recipe_from_dict(tree), echo=lambda _: None, on_step=on_step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert watched == [6, 7, 8, 9, 10]
    assert not sites, "host syncs in steady steps (count over 5 steps, site):\n" + "\n".join(
        f"{n:4d}  {s}" for s, n in sites.most_common())
