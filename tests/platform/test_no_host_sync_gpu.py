"""The training loop never makes the host wait for the GPU in a steady step (CUDA): with
``torch.cuda.set_sync_debug_mode("error")`` on from the warm-up's end, any synchronizing
call (``.item()``, a copy to pageable host memory, ``torch.cuda.synchronize``) in the forward,
backward, clipping, optimizer step or read-back raises. Compiled and eager regions, full and
block64 attention. Needs only torch, triton, TorchRec and pydantic (no Ray, no MLflow)."""

from __future__ import annotations

import pytest
import torch

from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train
from tests.platform.tiny_training import tiny_tree

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("attention", "compiled"), [("full", True), ("block64", True),
                                                     ("full", False)])
def test_steady_steps_never_sync_the_host(tmp_path, monkeypatch, attention, compiled):
    monkeypatch.chdir(tmp_path)
    # one progress line at the end only: a logging step reads its values back on purpose
    tree = tiny_tree(tmp_path / "data", steps=12, log_every=12, device="cuda",
                     compile=compiled, eval_max_samples=128)
    tree["model"]["attention"] = attention
    tree["parallel"]["use_gpu"] = True
    watched: list[int] = []

    def on_step(step: int, _model: object) -> None:
        if step == 5:
            torch.cuda.set_sync_debug_mode("error")
        elif step == 10:
            torch.cuda.set_sync_debug_mode(0)
        if 5 < step <= 10:
            watched.append(step)

    try:
        train(recipe_from_dict(tree), echo=lambda _: None, on_step=on_step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert watched == [6, 7, 8, 9, 10]
