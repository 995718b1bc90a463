"""A device that runs out of memory, explained: what the run held and which recipe fields
free memory, instead of the allocator's traceback.

A CUDA out-of-memory error says how much was allocated, not what to change. Training turns
it into ``DeviceMemoryError`` (a GemError, so the CLI prints it as one paragraph, and a
MemoryError, so callers that keep going after a failed run, such as the benchmarks' arms, still
catch it) naming the phase, the device's memory, the activation plan and the fields to change.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from gem_platform.errors import GemError
from gem_platform.recipe import Recipe
from gem_platform.train.regions import CheckpointPlan

GIB = 2**30
# Reserved but unallocated memory above this is fragmentation worth the allocator's setting.
FRAGMENTED_GIB = 2.0
EXPANDABLE = "expandable_segments:True"


class DeviceMemoryError(GemError, MemoryError):
    """The device ran out of memory; the message says what to change in the recipe."""


def memory_facts(device: torch.device) -> tuple[str, float]:
    """The device's memory in words, and its reserved-but-unallocated GiB (0 off CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "", 0.0
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    peak = torch.cuda.max_memory_allocated(device) / GIB
    free_reserved = (torch.cuda.memory_reserved(device)
                     - torch.cuda.memory_allocated(device)) / GIB
    return (f" ({torch.cuda.get_device_name(device)}: {total:.1f} GiB, peak allocated "
            f"{peak:.1f} GiB, {free_reserved:.1f} GiB reserved but unallocated)"), free_reserved


def memory_fixes(recipe: Recipe, plan: CheckpointPlan | None, fragmented_gib: float) -> str:
    """The recipe fields (and allocator setting) that lower the run's peak, the cheapest that
    can work first: where GiBs sit reserved but unallocated the memory is there in pieces, and
    expandable segments join them without recomputing anything, while a lower budget recomputes
    more."""
    budget = recipe.train.activation_memory_gb
    if budget is None:
        first = ("set train.activation_memory_gb below the device's memory less the training "
                 "state (`gemctl plan` on the recipe shows it per rank) and a few GB: the "
                 "regions recompute their forward to keep the activations within it")
    else:
        kept = f"; the plan kept ~{plan.kept_gb:.1f} GB" if plan is not None else ""
        first = f"lower train.activation_memory_gb (now {budget:g}{kept})"
    fixes = [first, f"lower loader.local_batch_size (now {recipe.loader.local_batch_size})"]
    if fragmented_gib > FRAGMENTED_GIB and EXPANDABLE not in os.environ.get(
            "PYTORCH_CUDA_ALLOC_CONF", ""):
        fixes.insert(0, f"set PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE} ({fragmented_gib:.1f} GiB "
                        "sit reserved but unallocated: fragmentation, which it joins without "
                        "recomputing)")
    return "; or ".join(fixes) + "."


@contextlib.contextmanager
def explained_out_of_memory(recipe: Recipe, device: torch.device, phase: str,
                            plan: CheckpointPlan | None = None) -> Iterator[None]:
    """Run the body; a device out-of-memory error in it becomes a DeviceMemoryError saying
    ``phase`` (e.g. "while setting up the run"), the memory facts and the fixes."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        facts, fragmented = memory_facts(device)
        first_line = str(err).splitlines()[0] if str(err) else "out of memory"
        activations = f" Activation plan: {plan.describe()}." if plan is not None else ""
        raise DeviceMemoryError(
            f"Recipe '{recipe.name}' ran out of device memory {phase}{facts}: "
            f"{first_line[:200]}.{activations}",
            memory_fixes(recipe, plan, fragmented)) from err
