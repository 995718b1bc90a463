"""One deterministic training step without clipping, in this process, and the gradient it
leaves on every parameter: what ``gem_bench.repro`` digests (does a run repeat?) and
``compile_check`` compares (does compiling change the gradients?).

Clipping is off because it scales every gradient by the global norm: one differing gradient
would make them all differ. Sparse tables trained by TorchRec's fused optimizer hold no
``.grad`` and are not included.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def step1_gradients(path: str, overrides: list[str]) -> dict[str, torch.Tensor]:
    """Train step 1 of the recipe at ``path`` (with ``overrides``) deterministically; each
    parameter's gradient (the local shard of a DTensor) as a CPU copy, in registration
    order."""
    from gem_platform.recipe import load_recipe
    from gem_platform.train.loop import train

    recipe = load_recipe(path, [*overrides, "train.deterministic=true", "train.steps=1",
                                "train.grad_clip=null", "train.eval_every=0"])
    recipe.train.eval_max_samples = recipe.loader.local_batch_size
    grads: dict[str, torch.Tensor] = {}

    def on_step(step: int, model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            grad = grad.to_local() if isinstance(grad, DTensor) else grad
            grads[name] = grad.detach().to("cpu", copy=True)

    train(recipe, echo=lambda _: None, on_step=on_step)
    return grads
