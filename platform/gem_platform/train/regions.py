"""The model's regions, compiled and (within a memory budget) recomputed.

A region is a module whose forward is one unit of work between the model's eager glue: each
sequence layer (its cost and activations grow with the batch's history tokens), each DHEN
layer and the head (they grow with samples). Two things are done per region:

- ``train.compile``: its training forward becomes ``torch.compile(forward, dynamic=True)``
  (token and sample counts change every batch, the graph does not), the attention ops inside as
  custom ops (gem_kernels.custom_ops), so nothing breaks the graph; evaluation runs eager.
  ``train.compile_regions`` narrows it to some regions (the others run eager): to find which
  region a compiled run's difference from an eager one comes from.
- ``train.activation_memory_gb``: the activations each region keeps for the backward are
  measured on a small input (bytes per token or per sample, saved-tensor hooks), scaled to the
  recipe's batch, and regions recompute their forward in the backward (non-reentrant
  checkpointing), the cheapest first (recompute FLOPs per byte saved), until the kept
  activations fit the budget.

The forward is replaced on the module instance, so parameter names and checkpoints are those
of the plain model; hooks on the module (FSDP's, the FLOP meter's) stay outside the compiled
and recomputed code. Regions are counted by the FLOP meter as a whole, once per call, so a
recomputed forward is not counted as useful work.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gem_platform.errors import GemError
from gem_platform.model.flops import count_by_rows, linear_flops_per_row

Unit = Literal["token", "sample"]


@dataclass(frozen=True)
class Region:
    """One region: its name in the model, the module and what its work grows with."""

    name: str
    module: nn.Module
    unit: Unit


def model_regions(model: nn.Module) -> list[Region]:
    """The regions of a GemModel (or of the module a parallel wrapper trains): sequence layers,
    DHEN layers, head. DHEN layers whose experts were swapped for an expert-parallel exchange
    are left out (their forward communicates)."""
    from gem_platform.model.interaction import MlpExpert

    out = [Region(f"sequence.blocks.{i}", b, "token")
           for i, b in enumerate(model.sequence.blocks)]
    for i, layer in enumerate(model.dhen):
        if isinstance(layer.experts, nn.ModuleList) and all(
                isinstance(e, MlpExpert) for e in layer.experts):
            out.append(Region(f"dhen.{i}", layer, "sample"))
    out.append(Region("head", model.head, "sample"))
    return out


@dataclass(frozen=True)
class RegionCost:
    """Per unit (token or sample) of a region: activation bytes kept for the backward beyond
    its input, and the forward FLOPs a recompute repeats."""

    saved_bytes: float
    input_bytes: float
    recompute_flops: float

    @property
    def freed_bytes(self) -> float:
        """What recomputing frees per unit: all it saves, less its input (kept anyway)."""
        return max(self.saved_bytes - self.input_bytes, 0.0)


def example_input(model: nn.Module, region: Region, units: int,
                  device: torch.device) -> tuple:
    """A small input of ``units`` tokens (sequence layers, as sequences of 64) or samples."""
    d = model.cfg.d_model
    if region.unit == "token":
        lengths = [min(64, units - i) for i in range(0, units, 64)]
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64,
                               device=device)
        x = torch.randn(units, d, device=device)
        if getattr(region.module, "side_qk", False):  # queries and keys from a side input
            return x, offsets, max(lengths), torch.randn(units, d, device=device)
        return x, offsets, max(lengths)
    tokens = model.num_dhen_tokens
    if region.name == "head":
        return (torch.randn(units, tokens * d, device=device),)
    return (torch.randn(units, tokens, d, device=device),)


def _saved_bytes(model: nn.Module, region: Region, device: torch.device,
                 autocast: Callable[[], object], units: int,
                 stored: Callable[[torch.Tensor], int] | None = None) -> tuple[int, int]:
    """Bytes autograd saves for the region's backward on ``units`` units of a random input
    (parameters and repeats of one storage left out), and the input's bytes. ``stored``: what
    keeping one saved tensor costs, when not its storage's bytes (train.saved_activations)."""
    params = {p.data_ptr() for p in region.module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            size = stored(t) if stored else t.untyped_storage().nbytes()
            seen[ptr] = max(seen.get(ptr, 0), size)
        return t

    inputs = example_input(model, region, units, device)
    x = inputs[0].requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        out = region.module(x, *inputs[1:])
    del out
    return sum(seen.values()), x.numel() * x.element_size()


def measure_cost(model: nn.Module, region: Region, device: torch.device,
                 autocast: Callable[[], object], units: int = 256,
                 stored: Callable[[torch.Tensor], int] | None = None) -> RegionCost:
    """Bytes the region saves for backward per unit and its forward FLOPs per unit, under
    ``autocast`` (the run's precision). Measured at ``units`` and twice as many units: the
    difference leaves out what does not grow with the batch (autocast's low-precision copies
    of the weights). ``stored`` as in ``_saved_bytes``."""
    one, input_bytes = _saved_bytes(model, region, device, autocast, units, stored)
    two, _ = _saved_bytes(model, region, device, autocast, 2 * units, stored)
    flops = linear_flops_per_row(region.module)
    if region.unit == "token":
        # attention: each token against about as many keys as the example's 64-token sequences
        flops += 4.0 * 64 * region.module.heads * region.module.head_dim
    return RegionCost(max(two - one, 0) / units, input_bytes / units, flops)


@dataclass
class CheckpointPlan:
    """Which regions recompute, and the activation estimate (GB) before and after."""

    recompute: list[str] = field(default_factory=list)
    kept_gb: float = 0.0
    full_gb: float = 0.0
    budget_gb: float | None = None
    recompute_flops_fraction: float = 0.0  # of the regions' forward FLOPs

    @property
    def fits(self) -> bool:
        return self.budget_gb is None or self.kept_gb <= self.budget_gb

    def describe(self) -> str:
        if self.budget_gb is None:
            return f"activations ~{self.full_gb:.1f} GB (no recompute budget)"
        which = ", ".join(self.recompute) or "none"
        fit = "" if self.fits else " (over budget even with every region recomputed)"
        return (f"activations ~{self.full_gb:.1f} GB -> ~{self.kept_gb:.1f} GB kept for "
                f"a {self.budget_gb:g} GB budget{fit}; recompute: {which} "
                f"(+{self.recompute_flops_fraction:.0%} region forward FLOPs, not counted "
                "as useful)")


def plan_checkpointing(regions: list[Region], costs: dict[str, RegionCost],
                       units: dict[Unit, float], budget_gb: float | None) -> CheckpointPlan:
    """Recompute regions, cheapest first (recompute FLOPs per byte freed), until the kept
    activations of all regions fit ``budget_gb`` at ``units`` tokens and samples per batch."""
    gb = 1e9
    full = sum(costs[r.name].saved_bytes * units[r.unit] for r in regions) / gb
    total_flops = sum(costs[r.name].recompute_flops * units[r.unit] for r in regions)
    plan = CheckpointPlan(kept_gb=full, full_gb=full, budget_gb=budget_gb)
    if budget_gb is None:
        return plan

    def price(r: Region) -> float:
        c = costs[r.name]
        return c.recompute_flops / c.freed_bytes if c.freed_bytes > 0 else math.inf

    recomputed_flops = 0.0
    for r in sorted(regions, key=price):
        if plan.kept_gb <= budget_gb:
            break
        c = costs[r.name]
        if c.freed_bytes <= 0:
            continue
        plan.recompute.append(r.name)
        plan.kept_gb -= c.freed_bytes * units[r.unit] / gb
        recomputed_flops += c.recompute_flops * units[r.unit]
    plan.recompute_flops_fraction = recomputed_flops / total_flops if total_flops else 0.0
    return plan


def _recomputed(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_regions(regions: list[Region], *, compile: bool, backend: str = "inductor",
                  recompute: list[str] | tuple[str, ...] = (),
                  compile_only: list[str] | None = None) -> None:
    """Give each region its compiled and/or recomputed forward (in place), and mark the
    sample regions to be counted by rows (their Linear layers see the input's rows).
    ``compile_only``: the regions compiled, by name or name prefix (None: all of them)."""
    unknown = set(recompute) - {r.name for r in regions}
    if unknown:
        raise ValueError(f"no region named {sorted(unknown)}; regions: "
                         f"{[r.name for r in regions]}")
    compiled = selected_regions(regions, compile_only) if compile else set()
    for r in regions:
        if r.unit == "sample":
            count_by_rows(r.module)
        forward = r.module.forward
        if r.name in recompute:
            forward = _recomputed(forward)
        if r.name in compiled:
            forward = _compiled_for_training(forward, r.module.forward, backend)
        if forward is not r.module.forward:
            r.module.forward = forward


def selected_regions(regions: list[Region], patterns: list[str] | None) -> set[str]:
    """The names of ``regions`` that ``patterns`` select: a region name, or a prefix of
    whole dotted parts ("sequence" selects "sequence.blocks.0"); None selects all. A pattern
    that selects nothing is an error naming the regions there are."""
    names = [r.name for r in regions]
    if patterns is None:
        return set(names)
    chosen: set[str] = set()
    for p in patterns:
        hits = {n for n in names if n == p or n.startswith(p + ".")}
        if not hits:
            raise GemError(f"train.compile_regions names {p!r}, which is no region of this "
                           f"model; its regions are {names}.",
                           "Name regions (or their prefixes: sequence, dhen, head) from that "
                           "list, or set train.compile_regions to null to compile all.")
        chosen |= hits
    return chosen


def _compiled_for_training(forward: Callable, eager: Callable, backend: str) -> Callable:
    """``forward`` compiled once with dynamic shapes (token and sample counts change every
    batch; compiling static first would recompile at the second batch), used while gradients
    are on. Evaluation (no_grad) calls ``eager``, so it compiles nothing."""
    compiled = torch.compile(forward, backend=backend, dynamic=True)

    @functools.wraps(eager)
    def run(*args, **kwargs):
        return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)

    return run


def batch_units(seq_lengths: torch.Tensor | list[int], local_batch: int) -> dict[Unit, float]:
    """Tokens and samples of a heavy batch: the mean history times the batch, plus three
    standard deviations of a batch's total (the batcher evens totals out; this is headroom)."""
    n = torch.as_tensor(seq_lengths, dtype=torch.float64)
    mean, std = float(n.mean()), float(n.std()) if n.numel() > 1 else 0.0
    return {"token": mean * local_batch + 3.0 * std * math.sqrt(local_batch),
            "sample": float(local_batch)}


def compile_enabled(setting: bool | None, device: torch.device) -> bool:
    """``train.compile`` resolved: null means on for CUDA, off on CPU. That holds for fp8_block
    too: its layers are opaque to the compiler (a graph break each) and the glue between them
    compiles (faster than eager at GEM width on the H200:
    docs/bench/e2e_h200_gem_fp8_compiled.json)."""
    if setting is not None:
        return setting
    return device.type == "cuda"


def compile_backend(setting: str | None) -> str:
    """``train.compile_backend`` resolved: null means inductor, deterministic runs included.
    Inductor's deterministic runs repeat bit for bit on the H200 since the DHEN layers' two
    causes of variation were removed (``interaction.self_gram`` and ``shared_grads``;
    docs/bench/determinism_h200_inductor_shared_grads.json), and they cost less than aot_eager
    (what each costs against a plain run: docs/bench). aot_eager stays selectable, to tell a
    generated kernel's difference from the model's own."""
    return setting or "inductor"


def setup_regions(model: nn.Module, *, compile: bool, backend: str,
                  budget_gb: float | None, units: dict[Unit, float], device: torch.device,
                  autocast: Callable[[], object],
                  stored: Callable[[torch.Tensor], int] | None = None,
                  compile_only: list[str] | None = None) -> CheckpointPlan:
    """Measure (when a budget is set), plan and apply: the one call the training loop makes.
    ``stored``: the bytes a saved tensor is kept in (gem_platform.train.saved_activations)."""
    regions = model_regions(model)
    costs = {}
    if budget_gb is not None:
        costs = {r.name: measure_cost(model, r, device, autocast, stored=stored)
                 for r in regions}
        plan = plan_checkpointing(regions, costs, units, budget_gb)
    else:
        plan = CheckpointPlan()
    apply_regions(regions, compile=compile, backend=backend, recompute=plan.recompute,
                  compile_only=compile_only)
    return plan
