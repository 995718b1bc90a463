"""Where a training step's time goes: a recipe trained for a few steps under torch.profiler.

A run's QPS and MFU say how fast it is, not why. This trains the recipe in-process for
``warmup + active`` steps (the warm-up absorbs autotuning and compilation), profiles the
``active`` ones, and reports per step: the wall time, the device's busy time (the sum of kernel
times; far below the wall time means the host is the bottleneck), the kernels launched, the
busy time by kind of kernel (matmul, our attention, element-wise, copy/fill, reduction,
optimizer, FP8 quantize and GEMM, gather/scatter, other), as time and as a share of the step,
and the costliest kernels.
Only device kernels (and copies) count: the profiler's own spans and user annotations such as
``Optimizer.step#AdamW.step`` cover kernels counted on their own and are left out. On a CPU run
the same tables rank the operators by their own CPU time. With ``--trace``, the device's idle
gaps are read back from the trace and charged to the host code that ended them
(``gem_profile.gaps``), and the host threads' time is charged to the spans that spent it
(``gem_profile.host``: what to cut when the step is launch-bound); with ``--out`` too, both go
beside the profile as ``<out stem>.gaps.json``.

    gemctl profile recipes/h200.yaml --set precision.mode=fp8_block --out gem_runs/fp8.json
    PYTHONPATH=kernels:platform:bench:. python -m gem_profile.profile ...   (without gemctl)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from gem_platform.errors import GemError
from gem_platform.provenance import environment
from gem_platform.recipe import Recipe, load_recipe
from gem_profile.gaps import report_trace_gaps

# First match wins: our kernels by their Triton names, then the compiler's (inductor names its
# Triton kernels triton_poi_* pointwise, triton_red_* / triton_per_* reductions, triton_tem_*
# templates: matmuls), then the libraries' by theirs.
KINDS: tuple[tuple[str, str], ...] = (
    ("fp8 quantize", r"quantize"),
    ("fp8 gemm (triton)", r"_gemm_body"),
    ("matmul", r"^triton_tem_"),
    ("reduction", r"^triton_(red|per)_"),
    ("element-wise", r"^triton_poi_"),
    ("attention (ours)", r"gdpa|jfa|block_attn|_block_|rope|^(fwd|bwd)_kernel"),
    # FBGEMM's table kernels before the matmul row: their names carry "fbgemm" ("gemm")
    ("gather / scatter", r"split_embedding|fbgemm_gpu|lru_cache|embedding_(forward|backward)"),
    ("matmul", r"gemm|xmma|cutlass|nvjet|cublas|matmul|addmm|\bb?mm\b|linear"),
    ("optimizer", r"multi_tensor|adam|foreach|optimizer"),
    ("gather / scatter", r"embedding|fbgemm|index|scatter|gather"),
    ("copy / fill", r"copy|memcpy|memset|fill|cat|pad|contiguous|to_copy"),
    ("reduction", r"reduce|sum|norm|amax"),
    ("element-wise",
     r"elementwise|vectorized|unrolled|pointwise|where|exp|silu|gelu|mul|add|sigmoid"),
)


def kernel_kind(name: str) -> str:
    """The kind a kernel (or, on CPU, an operator) is counted under."""
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


@dataclass
class KernelRow:
    """One kernel (or CPU operator): its time and calls per profiled step."""

    name: str
    kind: str
    ms_per_step: float
    calls_per_step: float
    share: float  # of the busy time


@dataclass
class StepProfile:
    """What a profiled step spent, averaged over the active steps."""

    recipe: str
    precision: str
    device: str
    environment: dict[str, Any]  # gem_platform.provenance.environment()
    active_steps: int
    step_ms: float  # wall time of a whole step (forward, backward, optimizer)
    busy_ms: float  # sum of kernel times (CUDA) or operator self times (CPU)
    busy_fraction: float
    # kernel launches (CUDA) or operator calls (CPU) per step: a launch-bound step's host cost
    # grows with them
    calls_per_step: float = 0.0
    by_kind: dict[str, float] = field(default_factory=dict)  # ms per step
    by_kind_of_step: dict[str, float] = field(default_factory=dict)  # fraction of step_ms
    top: list[KernelRow] = field(default_factory=list)
    resolved_recipe: dict = field(default_factory=dict)  # what was trained, overrides applied


def profile_recipe(recipe: Recipe, warmup: int = 20, active: int = 10, top: int = 25,
                   echo: Callable[[str], None] = print,
                   trace: str | Path | None = None) -> StepProfile:
    """Train ``recipe`` for ``warmup + active`` steps and profile the last ``active``; with
    ``trace``, also write those steps as a Chrome trace (Perfetto and chrome://tracing open
    it)."""
    from gem_platform.train.loop import pick_device, train

    if warmup < 2 or active < 1:
        raise GemError(f"warmup={warmup}, active={active}: profiling needs warmup >= 2 (the "
                       "profiler records nothing without one idle step before its own warm-up "
                       "step) and active >= 1.", "Pass --warmup N --active M with N >= 2, M >= 1.")
    total = warmup + active
    recipe = recipe.model_copy(deep=True)
    recipe.train.steps = total
    recipe.train.log_every = min(recipe.train.log_every, active)
    recipe.train.eval_every = 0
    recipe.train.eval_max_samples = recipe.loader.local_batch_size  # one batch: not profiled
    device = pick_device(recipe)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    marks: dict[int, float] = {}

    with profile(activities=activities,
                 schedule=schedule(wait=warmup - 1, warmup=1, active=active)) as prof:
        def on_step(step: int, _model: object) -> None:
            if step in (warmup, total):  # only there: a sync every step would stall the host
                if cuda:
                    torch.cuda.synchronize()
                marks[step] = time.perf_counter()
            prof.step()

        train(recipe, echo=echo, on_step=on_step)
    if trace is not None:
        prof.export_chrome_trace(str(trace))

    step_ms = (marks[total] - marks[warmup]) * 1e3 / active
    return summarize_profile(prof, recipe, str(device), cuda, active, step_ms, top)


def is_annotation(evt) -> bool:  # noqa: ANN001 (a profiler FunctionEventAvg)
    """True for the profiler's own spans (``ProfilerStep#N``) and user annotations such as
    ``Optimizer.step#AdamW.step``: on the device track they cover kernels counted on their
    own, and on CPU their self time is Python between operators, not an operator."""
    return bool(getattr(evt, "is_user_annotation", False)) or evt.key.startswith(
        ("ProfilerStep", "Optimizer.step", "Optimizer.zero_grad"))


def summarize_profile(prof, recipe: Recipe, device: str, cuda: bool, active: int,  # noqa: ANN001
                      step_ms: float, top: int) -> StepProfile:
    """A finished profiler's ``active`` steps as a StepProfile (steps of ``step_ms``)."""
    rows = []
    for evt in prof.key_averages():
        if cuda:
            if evt.device_type != DeviceType.CUDA:
                continue
            us = evt.self_device_time_total
        else:
            us = evt.self_cpu_time_total
        if us > 0 and not is_annotation(evt):
            rows.append((evt.key, us / 1e3 / active, evt.count / active))
    busy = sum(ms for _, ms, _ in rows)
    by_kind: dict[str, float] = {}
    for name, ms, _ in rows:
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    rows.sort(key=lambda r: r[1], reverse=True)
    return StepProfile(
        recipe=recipe.name, precision=_precision_label(recipe), device=device,
        environment=environment(), active_steps=active, step_ms=step_ms, busy_ms=busy,
        busy_fraction=busy / step_ms if step_ms > 0 else float("nan"),
        calls_per_step=sum(calls for _, _, calls in rows),
        by_kind=dict(sorted(by_kind.items(), key=lambda kv: kv[1], reverse=True)),
        by_kind_of_step={k: ms / step_ms if step_ms > 0 else float("nan")
                         for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        top=[KernelRow(name, kernel_kind(name), ms, calls, ms / busy if busy else 0.0)
             for name, ms, calls in rows[:top]],
        resolved_recipe=recipe.model_dump(mode="json"))


def _precision_label(recipe: Recipe) -> str:
    p = recipe.precision
    return f"fp8_block b{p.block}" if p.mode == "fp8_block" else p.mode


def render_profile(result: StepProfile, console=None) -> None:
    """Print the summary line and the two tables (by kind, costliest kernels)."""
    from rich.console import Console
    from rich.table import Table

    from gem_platform.markup import escape_text as escape

    console = console or Console()
    unit = "kernel" if result.device.startswith("cuda") else "operator"
    # Names (kernels, the recipe) are shown as written, never read as rich markup.
    console.print(f"[bold]{escape(result.recipe)}[/] ({escape(result.precision)}, "
                  f"{escape(result.device)}): "
                  f"step {result.step_ms:.1f} ms, {unit}s busy {result.busy_ms:.1f} ms "
                  f"({result.busy_fraction:.0%}), {result.calls_per_step:,.0f} {unit}s a step, "
                  f"over {result.active_steps} steps")
    kinds = Table("kind", "ms / step", "share of busy", "share of step")
    for kind, ms in result.by_kind.items():
        kinds.add_row(escape(kind), f"{ms:.2f}",
                      f"{ms / result.busy_ms:.1%}" if result.busy_ms else "-",
                      f"{ms / result.step_ms:.1%}" if result.step_ms > 0 else "-")
    console.print(kinds)
    table = Table(unit, "kind", "ms / step", "calls / step", "share")
    for r in result.top:
        name = r.name if len(r.name) <= 70 else r.name[:67] + "..."
        table.add_row(escape(name), escape(r.kind), f"{r.ms_per_step:.3f}",
                      f"{r.calls_per_step:.1f}",
                      f"{r.share:.1%}")
    console.print(table)


def write_profile(result: StepProfile, path: str | Path) -> Path:
    """The profile as JSON (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(result), indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/h200.yaml")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[],
                   help="override a recipe field (repeatable), e.g. precision.mode=fp8_block")
    p.add_argument("--warmup", type=int, default=20, help="steps before profiling (>= 2)")
    p.add_argument("--active", type=int, default=10, help="profiled steps")
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--out", help="write the profile as JSON here")
    p.add_argument("--trace", help="write the profiled steps as a Chrome/Perfetto trace here, "
                   "and report the device's idle gaps from it")
    p.add_argument("--min-gap-us", type=float, default=20.0,
                   help="shortest device idle gap counted (with --trace)")
    args = p.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        result = profile_recipe(recipe, args.warmup, args.active, args.top,
                                trace=args.trace)
    except GemError as err:
        print(err.as_text(), file=sys.stderr)
        return 2
    render_profile(result)
    if args.out:
        print(f"profile: {write_profile(result, args.out)}")
    if args.trace:
        print(f"trace: {args.trace}")
        gaps = report_trace_gaps(args.trace, args.out, min_gap_us=args.min_gap_us)
        if gaps:
            print(f"gaps: {gaps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
