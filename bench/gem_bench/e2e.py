"""gemctl bench e2e: a recipe trained end to end by the platform's own build and, in the same
run on the same data, by the same model from off-the-shelf parts.

Arms (each trains ``warmup + steps + 1 + profile`` steps, one arm after the other):

- ``ours``: the recipe as it is (Triton kernels, compiled regions where train.compile is on,
  prefetched input, fused tables where fbgemm-gpu's CUDA build runs, fused AdamW on CUDA).
- ``off_the_shelf``: ``model.kernel=baseline`` (varlen_attn self-attention, padded compiled
  GDPA for cross and pooled attention), eager glue (train.compile=false), input collated on
  the training thread (train.prefetch_batches=0), plain tables with a dense optimizer step.

Arms on request (``--arms``), each the recipe with one lever changed, to see what it is worth:

- ``off_the_shelf_compiled``: ``model.kernel=baseline`` alone: off-the-shelf attention with
  everything else of ours (compiled regions, prefetched input, fused tables): the strongest
  build a user could assemble without our kernels;

- ``ours_dense_tables``: ours with plain tables and a dense optimizer step (what TorchRec's
  fused path adds where fbgemm-gpu's CUDA build runs);
- ``ours_fp8_saved``: ours with ``train.saved_activations=fp8`` (memory against speed);
- ``ours_eager``: ours with ``train.compile=false`` (what compiled regions add);
- ``ours_fp8_block``: ours with ``precision.mode=fp8_block`` (8-bit block-scaled matmuls
  against the recipe's precision, in the same run);
- ``ours_fp8_wgrad``: the same with the weight gradients in FP8 too (``precision.wgrad=fp8``;
  GEM keeps them in higher precision: the third of the matmul FLOPs FP8 otherwise leaves bf16);
- ``ours_deterministic``: ours with ``train.deterministic=true`` (what bitwise repeatability
  costs, cuBLAS's reproducible workspace setting included).

Each arm trains in a fresh process (spawned), so nothing one arm leaves behind (compiled
graphs and Dynamo's caches, the allocator's pools, cuBLAS's workspace setting, the profiler)
changes the next one's figures; ``--same-process`` trains them all in this one instead
(quicker to start, for small CPU runs).

Per arm: samples/s and E2E MFU over the ``steps`` timed steps (after ``warmup`` steps that pay
compilation and autotuning), the graphs and kernels still compiled during the timed steps
(late compiles: their time is in the figures), peak device memory, the CPU time the training
thread (and the whole process) spent per timed step (host ms: near the step time, the host's
own work paces the step; far below it, the host waited), and the step's time by kind of
kernel from torch.profiler over the last ``profile`` steps (not timed). The ratio is
ours / off-the-shelf samples/s. Prints a table and writes JSON.

A launch-bound recipe's samples/s vary from one process to the next by more than many of the
differences worth measuring (docs/bench has the small recipe's spread on the H200).
``--repeats N`` trains every arm N times, in rounds that take
the arms in turn (so a drift of the machine reaches every arm alike), each run in a fresh
process; an arm then reports the median run's figures with every run's samples/s and host ms
in a table of runs. "vs ours" compares medians; the runs table divides each run by ours in the
same round, which cancels the machine's drift from round to round, and gives those ratios'
median (the lower middle where the count is even).

    gemctl bench e2e recipes/h200_gem.yaml --set model.attention=block64 --out docs/bench
    python -m gem_bench.e2e recipes/h200_gem.yaml --out docs/bench
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from gem_bench import baseline  # noqa: F401  registers the off_the_shelf arms' variant here
from gem_platform.errors import GemError
from gem_platform.fresh_process import call_in_fresh_process
from gem_platform.recipe import Recipe, apply_overrides, load_recipe, recipe_from_dict


@dataclass(frozen=True)
class Arm:
    """How an arm differs from the recipe: overrides, and whether its tables stay plain
    modules with a dense optimizer step (``parallel.single.plain_tables``)."""

    overrides: tuple[str, ...] = ()
    plain_tables: bool = False


ARMS: dict[str, Arm] = {
    "ours": Arm(),
    "off_the_shelf": Arm(("model.kernel=baseline", "train.compile=false",
                          "train.prefetch_batches=0"), plain_tables=True),
    # the strong off-the-shelf build: off-the-shelf attention, but compiled, with prefetched
    # input and TorchRec's fused tables, as a careful user would run it
    "off_the_shelf_compiled": Arm(("model.kernel=baseline",)),
    "ours_dense_tables": Arm(plain_tables=True),
    "ours_fp8_saved": Arm(("train.saved_activations=fp8",)),
    "ours_eager": Arm(("train.compile=false",)),
    "ours_fp8_block": Arm(("precision.mode=fp8_block",)),
    "ours_fp8_wgrad": Arm(("precision.mode=fp8_block", "precision.wgrad=fp8")),
    "ours_deterministic": Arm(("train.deterministic=true",)),
}
DEFAULT_ARMS = ("ours", "off_the_shelf")
DEFAULT_RECIPE = "recipes/h200_gem.yaml"


@dataclass
class ArmResult:
    """One arm's measurements (times per step in ms)."""

    name: str
    overrides: list[str]
    samples_per_s: float
    mfu_e2e: float
    peak_memory_gb: float | None
    step_ms: float
    train_tflops_per_step: float
    warmup_s: float  # start of the arm to the end of its warm-up: data, build, compile, autotune
    busy_fraction: float
    by_kind_ms: dict[str, float] = field(default_factory=dict)
    by_kind_of_step: dict[str, float] = field(default_factory=dict)
    final_loss: float = float("nan")
    compiles_after_warmup: int = 0  # graphs and Triton kernels compiled during timed steps
    error: str | None = None  # why the arm did not finish (e.g. out of memory); then NaNs
    runs_samples_per_s: list[float] = field(default_factory=list)  # every run, in order
    # CPU time per timed step of the training thread and of the whole process (all threads):
    # a launch-bound step whose host_thread_ms nears step_ms is the host's work; a step far
    # longer than it waited (the GIL, the device, a descheduled thread)
    host_thread_ms: float = float("nan")
    host_process_ms: float = float("nan")
    runs_host_thread_ms: list[float] = field(default_factory=list)  # every run, in order
    # this arm's samples/s over ours' in each round both finished: a ratio within a round is
    # free of the machine's drift between rounds
    vs_ours_by_round: list[float] = field(default_factory=list)


def lower_middle(items: list, key: Callable | None = None):  # noqa: ANN202 (an item)
    """The median item, the lower of the two middle ones where the count is even: always one
    that was measured, never an average of two."""
    return sorted(items, key=key)[(len(items) - 1) // 2]


def median_run(name: str, runs: list[ArmResult]) -> ArmResult:
    """An arm trained several times, reported by its median run (the lower of the two middle
    runs where the count is even) with every finished run's samples/s in
    ``runs_samples_per_s``; a failed run is left out, and an arm whose runs all failed keeps
    the first run's error."""
    done = [r for r in runs if r.error is None]
    if not done:
        return runs[0]
    middle = lower_middle(done, key=lambda r: r.samples_per_s)
    return replace(middle, name=name, runs_samples_per_s=[r.samples_per_s for r in done],
                   runs_host_thread_ms=[r.host_thread_ms for r in done])


def ratios_by_round(runs: list[ArmResult], base: list[ArmResult]) -> list[float]:
    """samples/s of ``runs`` over ``base``'s, round by round, where both runs finished."""
    return [r.samples_per_s / b.samples_per_s for r, b in zip(runs, base, strict=True)
            if r.error is None and b.error is None]


def failed_arm(name: str, overrides: list[str], err: BaseException) -> ArmResult:
    """An arm that raised: recorded with its error, so the other arm's result is kept."""
    nan = float("nan")
    return ArmResult(name=name, overrides=overrides, samples_per_s=nan, mfu_e2e=nan,
                     peak_memory_gb=None, step_ms=nan, train_tflops_per_step=nan,
                     warmup_s=nan, busy_fraction=nan,
                     error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")


@dataclass
class E2EResult:
    recipe: str
    attention: str
    precision: str
    device: str
    environment: dict[str, Any]  # gem_platform.provenance.environment()
    warmup_steps: int
    timed_steps: int
    profiled_steps: int
    local_batch: int
    fused_tables: bool
    arms: list[ArmResult]
    speedup: float | None  # ours / off_the_shelf samples/s
    resolved_recipe: dict
    repeats: int = 1  # runs per arm (their median reported)
    code: dict = field(default_factory=dict)  # {"commit", "dirty"} of the code that ran


def arm_recipe(recipe: Recipe, overrides: list[str], total_steps: int, warmup: int) -> Recipe:
    """The recipe with the arm's overrides, trained ``total_steps`` steps, evaluated on one
    batch, without checkpoints."""
    tree = apply_overrides(recipe.model_dump(mode="json"), overrides)
    r = recipe_from_dict(tree, f"{recipe.name} ({' '.join(overrides) or 'as is'})")
    r.train.steps = total_steps
    r.train.log_every = total_steps
    r.train.eval_every = 0
    r.train.eval_max_samples = r.loader.local_batch_size
    r.train.perf_warmup_steps = min(warmup, total_steps - 1)
    return r


def run_arm(recipe: Recipe, name: str, arm: Arm, warmup: int, steps: int,
            profiled: int, echo: Callable[[str], None] = print) -> ArmResult:
    """Train one arm and measure it (see the module docstring)."""
    from gem_platform.parallel.single import plain_tables
    from gem_platform.train.loop import pick_device, train
    from gem_profile.profile import summarize_profile

    total = warmup + steps + 1 + profiled
    overrides = list(arm.overrides)
    r = arm_recipe(recipe, overrides, total, warmup)
    device = pick_device(r)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    marks: dict[int, float] = {}
    # step -> (training thread, process) CPU seconds before and after that step's sync, so the
    # timed window's CPU time leaves out the spin-wait of the syncs that bound it
    cpu: dict[int, tuple[tuple[float, float], tuple[float, float]]] = {}
    clocked = {warmup, warmup + steps, total - profiled, total}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    tables = plain_tables() if arm.plain_tables else contextlib.nullcontext()
    echo(f"[{name}] {total} steps ({warmup} warm-up, {steps} timed, 1 + {profiled} profiled)")
    start = time.perf_counter()
    with profile(activities=activities,
                 schedule=schedule(wait=warmup + steps, warmup=1, active=profiled)) as prof:
        def on_step(step: int, _model: object) -> None:
            if step in clocked:  # only there: a sync every step would stall the host's lead
                before = (time.thread_time(), time.process_time())
                sync()
                marks[step] = time.perf_counter()
                cpu[step] = (before, (time.thread_time(), time.process_time()))
            prof.step()

        with tables:
            summary = train(r, echo=echo, on_step=on_step)
    timed_s = marks[warmup + steps] - marks[warmup]
    (thread0, process0), (thread1, process1) = cpu[warmup][1], cpu[warmup + steps][0]
    prof_ms = (marks[total] - marks[total - profiled]) * 1e3 / profiled
    step_profile = summarize_profile(prof, r, str(device), cuda, profiled, prof_ms, top=1)
    flops = float(summary["perf/train_flops_per_step"])
    peak = float(summary["perf/peak_tflops"]) * 1e12
    result = ArmResult(
        name=name, overrides=overrides,
        samples_per_s=r.loader.local_batch_size * steps / timed_s,
        mfu_e2e=flops * steps / timed_s / peak,
        peak_memory_gb=summary.get("perf/peak_memory_gb"),
        step_ms=timed_s * 1e3 / steps, train_tflops_per_step=flops / 1e12,
        warmup_s=marks[warmup] - start, busy_fraction=step_profile.busy_fraction,
        by_kind_ms=step_profile.by_kind, by_kind_of_step=step_profile.by_kind_of_step,
        final_loss=float(summary["train/final_loss"]),
        compiles_after_warmup=int(summary.get("perf/compiles_after_warmup", 0)),
        host_thread_ms=(thread1 - thread0) * 1e3 / steps,
        host_process_ms=(process1 - process0) * 1e3 / steps)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _one_arm(recipe: Recipe, name: str, label: str, warmup: int, steps: int, profiled: int,
             echo: Callable[[str], None], isolate: bool) -> ArmResult:
    """One run of arm ``name``, in a fresh process unless ``isolate`` is off; a run that
    raised is recorded with its error."""
    try:
        args = (recipe, label, ARMS[name], warmup, steps, profiled)
        return (call_in_fresh_process(run_arm, *args, echo=echo) if isolate
                else run_arm(*args, echo=echo))
    # torch.OutOfMemoryError and a child that died without answering are RuntimeErrors
    except (RuntimeError, MemoryError) as err:
        echo(f"[{label}] failed: {err}")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return failed_arm(name, list(ARMS[name].overrides), err)


def bench(recipe: Recipe, warmup: int = 10, steps: int = 20, profiled: int = 3,
          arms: list[str] | None = None, echo: Callable[[str], None] = print,
          isolate: bool = True, repeats: int = 1) -> E2EResult:
    """Every arm of ``arms`` (default ours and off-the-shelf) on ``recipe``, one after the
    other, each in a fresh process unless ``isolate`` is off; with ``repeats`` > 1, that many
    rounds of every arm, each arm reported by its median run."""
    from gem_platform.parallel.single import fused_tbe_available
    from gem_platform.provenance import code_version, environment
    from gem_platform.train.loop import pick_device

    if warmup < 1 or steps < 1 or profiled < 1 or repeats < 1:
        raise GemError(f"warmup={warmup}, steps={steps}, profile={profiled}, "
                       f"repeats={repeats}: each must be >= 1.",
                       "Pass --warmup, --steps, --profile-steps and --repeats of at least 1.")
    names = arms or list(DEFAULT_ARMS)
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        raise GemError(f"Unknown arm(s) {unknown}.", f"Choose from {list(ARMS)}.")
    if len(set(names)) < len(names):
        raise GemError(f"Arms {names} name one arm twice.",
                       "Name each arm once; --repeats trains every arm several times.")
    device = pick_device(recipe)
    runs: dict[str, list[ArmResult]] = {a: [] for a in names}
    for round_ in range(repeats):
        for a in names:
            label = a if repeats == 1 else f"{a} (run {round_ + 1} of {repeats})"
            runs[a].append(_one_arm(recipe, a, label, warmup, steps, profiled, echo, isolate))
    results = [median_run(a, runs[a]) for a in names]
    if repeats > 1 and "ours" in runs:
        results = [replace(r, vs_ours_by_round=ratios_by_round(runs[r.name], runs["ours"]))
                   for r in results]
    by = {a.name: a for a in results if a.error is None}
    speedup = (by["ours"].samples_per_s / by["off_the_shelf"].samples_per_s
               if {"ours", "off_the_shelf"} <= by.keys() else None)
    p = recipe.precision
    return E2EResult(
        recipe=recipe.name, attention=recipe.model.attention,
        precision=f"fp8_block b{p.block}" if p.mode == "fp8_block" else p.mode,
        device=str(device), environment=environment(), warmup_steps=warmup,
        timed_steps=steps, profiled_steps=profiled,
        local_batch=recipe.loader.local_batch_size,
        fused_tables=fused_tbe_available(device) and device.type == "cuda", arms=results,
        speedup=speedup, resolved_recipe=recipe.model_dump(mode="json"), code=code_version(),
        repeats=repeats)


_ARM_ROWS: tuple[tuple[str, Callable[[ArmResult], str]], ...] = (
    ("samples/s", lambda a: f"{a.samples_per_s:,.0f}"),
    ("E2E MFU", lambda a: f"{a.mfu_e2e:.1%}"),
    ("peak GB", lambda a: "-" if a.peak_memory_gb is None else f"{a.peak_memory_gb:.1f}"),
    ("ms / step", lambda a: f"{a.step_ms:.1f}"),
    ("host ms / step", lambda a: f"{a.host_thread_ms:.1f}"),
    ("busy", lambda a: f"{a.busy_fraction:.0%}"),
    ("warm-up s", lambda a: f"{a.warmup_s:.0f}"),
    ("late compiles", lambda a: str(a.compiles_after_warmup)),
)


def render(result: E2EResult, console=None) -> None:  # noqa: ANN001 (rich Console)
    """The arms side by side, then (with repeats) every run, then each kind of kernel's time
    per step."""
    from rich.console import Console
    from rich.table import Table

    from gem_platform.markup import escape_text as escape

    console = console or Console()
    ratio = f", ours / off-the-shelf {result.speedup:.2f}x" if result.speedup else ""
    runs = f", median of {result.repeats} runs per arm" if result.repeats > 1 else ""
    console.print(escape(f"{result.recipe} ({result.attention}, {result.precision}, "
                         f"{result.device}, batch {result.local_batch}){ratio}{runs}"))
    base = next((a.samples_per_s for a in result.arms if a.name == "ours" and not a.error), None)
    # arms as columns, as in the kinds table below: fits a narrow terminal however many figures
    arms = Table("", *[a.name for a in result.arms])
    for label, cell in _ARM_ROWS + ((("vs ours", lambda a: f"{a.samples_per_s / base:.2f}x"),)
                                    if base else ()):
        arms.add_row(label, *[(escape(a.error[:60]) if label == "samples/s" else "")
                              if a.error else cell(a) for a in result.arms])
    console.print(arms)
    if result.repeats > 1:
        console.print(_runs_table(result))
    kinds = sorted({k for a in result.arms for k in a.by_kind_ms},
                   key=lambda k: -max(a.by_kind_ms.get(k, 0.0) for a in result.arms))
    table = Table("kind", *[a.name for a in result.arms],
                  title="kernel time, ms a step (share of the step)")
    for k in kinds:
        table.add_row(escape(k), *[f"{a.by_kind_ms.get(k, 0.0):.2f} "
                                   f"({a.by_kind_of_step.get(k, 0.0):.0%})" for a in result.arms])
    console.print(table)


def _runs_table(result: E2EResult):  # noqa: ANN202 (a rich Table)
    """Every finished run of every arm, in order, with its ratio to ours in the same round
    (where no round of the two failed) and the median of those ratios."""
    from rich.table import Table

    runs = Table("arm", "run", "samples/s", "host ms", "vs ours, same round")
    for a in result.arms:
        if a.error:
            continue
        by_round = (a.vs_ours_by_round if len(a.vs_ours_by_round) == len(a.runs_samples_per_s)
                    else [])
        for i, (q, h) in enumerate(zip(a.runs_samples_per_s, a.runs_host_thread_ms,
                                       strict=True)):
            runs.add_row(a.name if i == 0 else "", str(i + 1), f"{q:,.0f}", f"{h:.1f}",
                         f"{by_round[i]:.2f}x" if by_round else "-")
        if a.vs_ours_by_round:
            runs.add_row("", "median", "", "", f"{lower_middle(a.vs_ours_by_round):.2f}x")
    return runs


def write(result: E2EResult, out: str | Path) -> Path:
    """JSON at ``out/e2e_<recipe>_<attention>.json`` (folder created)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"e2e_{result.recipe}_{result.attention}.json"
    path.write_text(json.dumps(asdict(result), indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE, help="recipe YAML")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[],
                   help="override a recipe field (repeatable), e.g. model.attention=block64")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per arm")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per arm")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help=f"comma-separated, of {list(ARMS)}")
    p.add_argument("--quick", action="store_true", help="3 warm-up, 5 timed, 2 profiled steps")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per arm, in rounds taking the arms in turn; each arm reports its "
                   "median run (for launch-bound recipes, whose speed varies by process)")
    p.add_argument("--same-process", action="store_true",
                   help="train every arm in this process (default: each in a fresh one)")
    p.add_argument("--out", default="docs/bench", help="folder for the JSON result")
    args = p.parse_args(argv)
    warmup, steps, profiled = ((3, 5, 2) if args.quick
                               else (args.warmup, args.steps, args.profile_steps))
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        result = bench(recipe, warmup, steps, profiled, args.arms.split(","),
                       isolate=not args.same_process, repeats=args.repeats)
    except GemError as err:
        print(err.as_text(), file=sys.stderr)
        return 2
    render(result)
    print(f"e2e: {write(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
