"""gemctl bench quality: time to a target held-out NE, ours against the builds a user would
run instead, on the same data in the same run (MLPerf's recommendation benchmark times
training to a target AUC for the same reason: more samples per second is only worth having
if the model reaches the same quality sooner).

Each arm (gem_bench.e2e.ARMS: ``ours``, ``off_the_shelf``,
``off_the_shelf_compiled``, ...) trains the whole recipe in a fresh process, evaluating a fixed
held-out sample ``--evals`` times along the way (train.eval_sample samples, the same ones every
time and in every arm), then the recipe's full evaluation. From each arm's curve: the training
seconds and samples at which held-out CTR NE first reaches the target (interpolated between
evaluations; evaluation time is not training time), the final NE and AUC and the share of the
planted ceiling's AUC lift on synthetic data, samples/s and E2E MFU.

The target is ``--target-ne``, or by default the worst of the arms' best NEs: the best
quality every arm reached, so each arm has a time to it. The JSON is rewritten after each arm,
so a run stopped during a later arm keeps the finished ones.

Arms too long for one job go in several: ``--add-to FILE`` keeps the arms of an earlier result
of the same resolved recipe on the same device (an arm named again is trained anew) and places
them all against one target.

    gemctl bench quality recipes/h200_gem.yaml --out docs/quality
    gemctl bench quality recipes/h200_gem.yaml --arms off_the_shelf_compiled \
        --add-to docs/quality/quality_h200_gem_full.json --out docs/quality
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gem_platform.errors import GemError
from gem_platform.json_results import write_json
from gem_platform.recipe import Recipe, apply_overrides, load_recipe, recipe_from_dict

DEFAULT_ARMS = ("ours", "off_the_shelf", "off_the_shelf_compiled")


@dataclass
class QualityArm:
    """One arm's learning curve and what it reached."""

    name: str
    overrides: list[str]
    curve: list[dict] = field(default_factory=list)  # learning.EvalPoint.to_json() each
    final: dict[str, float] = field(default_factory=dict)  # eval/* of the full evaluation
    samples_per_s: float = math.nan
    mfu_e2e: float = math.nan
    train_s: float = math.nan  # training seconds of the whole run (evaluation excluded)
    train_s_to_target: float | None = None
    samples_to_target: float | None = None
    error: str | None = None
    # what the start-up was made of: perf/compile_s_torch, compile_s_triton,
    # triton_kernels_compiled, tuning_s_gdpa of the run summary (absent in older results)
    compiling: dict[str, float] = field(default_factory=dict)
    # perf/peak_memory_gb (CUDA) and, under an activation budget, perf/activations_kept_gb
    memory: dict[str, float] = field(default_factory=dict)

    def best_ne(self) -> float:
        values = [p["ne_ctr"] for p in self.curve if not math.isnan(p.get("ne_ctr", math.nan))]
        return min(values, default=math.nan)

    @property
    def startup_s(self) -> float:
        """Training seconds beyond what the run's samples take at its steady samples/s: the
        one-off cost of compiling and warming up, which a short run pays in full."""
        if not self.curve or not self.samples_per_s > 0:
            return math.nan
        return self.train_s - self.curve[-1]["samples"] / self.samples_per_s

    @property
    def steady_s_to_target(self) -> float | None:
        """Seconds to the target at the steady samples/s, the start-up left out: what the
        time to quality tends to on a run long enough for it not to count."""
        if self.samples_to_target is None or not self.samples_per_s > 0:
            return None
        return self.samples_to_target / self.samples_per_s


@dataclass
class QualityResult:
    recipe: str
    target_ne: float | None
    target_source: str  # "given" or "worst of the arms' best"
    ceiling: dict[str, float]
    arms: list[QualityArm]
    resolved_recipe: dict
    environment: dict = field(default_factory=dict)
    code: dict = field(default_factory=dict)
    code_of_added_arms: dict | None = None  # the earlier run's, where arms were added to it


_DERIVED = ("startup_s", "steady_s_to_target")  # written beside each arm, computed on load


def load_result(path: str | Path, option: str = "--add-to") -> QualityResult:
    """A result written by ``write`` (``option`` names where its path came from, for errors)."""
    try:
        data = json.loads(Path(path).read_text())
        arms = [QualityArm(**{k: v for k, v in row.items() if k not in _DERIVED})
                for row in data.pop("arms")]
        return QualityResult(arms=arms, **data)
    except FileNotFoundError as err:
        raise GemError(f"{option} {path}: no such file.",
                       "Name a quality_*.json that gemctl bench quality wrote.") from err
    except (ValueError, TypeError, KeyError) as err:
        raise GemError(f"{option} {path} is no gemctl bench quality result ({err}).",
                       "Name a quality_*.json that gemctl bench quality wrote.") from err


def check_addable(earlier: QualityResult, recipe: dict, environment: dict) -> None:
    """Arms compare only on the same resolved recipe (data, schedule, evaluation) and device."""
    if earlier.resolved_recipe != recipe:
        changed = sorted(k for k in recipe.keys() | earlier.resolved_recipe.keys()
                         if recipe.get(k) != earlier.resolved_recipe.get(k))
        raise GemError(f"--add-to: the earlier result trained another recipe (sections that "
                       f"differ: {', '.join(changed)}).",
                       "Pass the same recipe and --set overrides as the earlier run.")
    then, now = earlier.environment.get("device"), environment.get("device")
    if then != now:
        raise GemError(f"--add-to: the earlier result ran on {then}, this run on {now}.",
                       "Time to quality compares arms on the same device: run them all there.")


def arm_recipe(recipe: Recipe, overrides: list[str], evals: int) -> Recipe:
    """The recipe with the arm's overrides, evaluated ``evals`` times, without checkpoints."""
    tree = apply_overrides(recipe.model_dump(mode="json"), overrides)
    r = recipe_from_dict(tree, f"{recipe.name} ({' '.join(overrides) or 'as is'})")
    r.train.eval_every = max(r.train.steps // evals, 1)
    r.train.checkpoint_every = 0
    return r


# the run-summary entries that say what an arm's start-up was made of
COMPILING = ("perf/compile_s_torch", "perf/compile_s_triton", "perf/triton_kernels_compiled",
             "perf/tuning_s_gdpa")
MEMORY = ("perf/peak_memory_gb", "perf/activations_kept_gb")


def run_arm(recipe: Recipe, name: str, evals: int, echo: Callable[[str], None] = print
            ) -> QualityArm:
    """Train one arm to the end of the recipe and keep its curve."""
    from gem_bench.e2e import ARMS
    from gem_platform.parallel.single import plain_tables
    from gem_platform.train.learning_report import held_out_scores
    from gem_platform.train.loop import train

    arm = ARMS[name]
    r = arm_recipe(recipe, list(arm.overrides), evals)
    echo(f"[{name}] {r.train.steps} steps, held-out evaluation every {r.train.eval_every}")
    tables = plain_tables() if arm.plain_tables else contextlib.nullcontext()
    with tables:
        summary = train(r, echo=lambda line: echo(f"[{name}] {line}"))
    return QualityArm(
        name=name, overrides=list(arm.overrides),
        curve=list(summary.get("quality/eval_curve", [])),
        final=held_out_scores(summary),
        samples_per_s=float(summary.get("perf/qps", math.nan)),
        mfu_e2e=float(summary.get("perf/mfu_e2e", math.nan)),
        train_s=float(summary.get("perf/train_s", math.nan)),
        compiling=_entries(summary, COMPILING), memory=_entries(summary, MEMORY))


def _entries(summary: dict, keys: tuple[str, ...]) -> dict[str, float]:
    return {k.removeprefix("perf/"): float(summary[k]) for k in keys if k in summary}


def _one_arm(recipe: Recipe, name: str, evals: int, echo: Callable[[str], None],
             isolate: bool) -> QualityArm:
    from gem_bench.e2e import ARMS
    from gem_platform.fresh_process import call_in_fresh_process

    try:
        return (call_in_fresh_process(run_arm, recipe, name, evals, echo=echo) if isolate
                else run_arm(recipe, name, evals, echo=echo))
    except (RuntimeError, MemoryError) as err:  # out of memory, a child that died
        echo(f"[{name}] failed: {err}")
        return QualityArm(name=name, overrides=list(ARMS[name].overrides),
                          error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")


def pick_target(arms: list[QualityArm], given: float | None) -> tuple[float | None, str]:
    """The given target, else the worst of the finished arms' best held-out NEs."""
    if given is not None:
        return given, "given"
    bests = [a.best_ne() for a in arms if a.error is None and not math.isnan(a.best_ne())]
    return (max(bests), "worst of the arms' best") if bests else (None, "no arm evaluated")


def reach(arm: QualityArm, target: float) -> tuple[float | None, float | None]:
    """The arm's training seconds and samples to ``target`` (None, None: never reached)."""
    from gem_platform.train.learning import time_to_target

    hit = time_to_target([(p["step"], p["samples"], p["train_s"], p["ne_ctr"])
                          for p in arm.curve], target)
    return (hit.train_s, hit.samples) if hit else (None, None)


def place_target(arms: list[QualityArm], target: float | None) -> None:
    """Each arm's training seconds and samples to ``target`` (None where never reached)."""
    for a in arms:
        if target is None or a.error:
            continue
        a.train_s_to_target, a.samples_to_target = reach(a, target)


def bench(recipe: Recipe, arms: list[str] | None = None, target_ne: float | None = None,
          evals: int = 10, echo: Callable[[str], None] = print, isolate: bool = True,
          on_arm: Callable[[QualityResult], None] | None = None,
          earlier: QualityResult | None = None) -> QualityResult:
    """Every arm trained on ``recipe`` one after the other, then placed against the target,
    beside the arms of ``earlier`` not named again. ``on_arm`` receives the result so far after
    each arm (the finished arms placed against their own target), so a run stopped during a
    later arm keeps the earlier ones."""
    from gem_bench.e2e import ARMS
    from gem_platform.data.parquet import load_meta
    from gem_platform.provenance import code_version, environment

    names = arms or list(DEFAULT_ARMS)
    unknown = [a for a in names if a not in ARMS]
    if unknown or len(set(names)) < len(names):
        raise GemError(f"Arms {names}: each must be one of {list(ARMS)}, named once.",
                       "Pass --arms as a comma-separated list of distinct arm names.")
    if evals < 2:
        raise GemError(f"--evals {evals} gives no curve.", "Pass --evals of at least 2.")
    context = {"resolved_recipe": recipe.model_dump(mode="json"), "environment": environment(),
               "code": code_version()}
    results: list[QualityArm] = []
    if earlier is not None:
        check_addable(earlier, context["resolved_recipe"], context["environment"])
        results = [a for a in earlier.arms if a.name not in names]
        context["code_of_added_arms"] = earlier.code
    for name in names:
        results.append(_one_arm(recipe, name, evals, echo, isolate))
        target, source = pick_target(results, target_ne)
        place_target(results, target)
        result = QualityResult(recipe=recipe.name, target_ne=target, target_source=source,
                               ceiling=dict(load_meta(recipe.data.path).planted_auc or {}),
                               arms=list(results), **context)
        if on_arm:
            on_arm(result)
    return result


ROWS = ("final NE", "final AUC", "share of ceiling lift", "samples/s", "E2E MFU",
        "peak GB (activations kept GB)",
        "train s to target", "samples to target", "time vs ours", "start-up s (compile, warm-up)",
        "  torch.compile s / Triton JIT s (kernels) / GDPA tuning s", "steady s to target",
        "steady time vs ours")


def _cells(a: QualityArm, ours: QualityArm | None, ceiling: dict[str, float]) -> list[str]:
    """One arm's row: the error in place of its figures where it did not finish."""
    if a.error:
        return [a.error[:60], *[""] * (len(ROWS) - 1)]
    def fmt(x: float | None, spec: str) -> str:  # noqa: E306
        return "never" if x is None else ("-" if math.isnan(x) else format(x, spec))

    ne, auc = a.final.get("eval/ne_ctr", math.nan), a.final.get("eval/auc_ctr", math.nan)
    ceil = ceiling.get("ctr")
    share = (auc - 0.5) / (ceil - 0.5) if ceil and ceil > 0.5 else math.nan
    def vs(theirs: float | None, base: float | None) -> str:
        return f"{theirs / base:.2f}x" if theirs and base else "-"

    return [fmt(ne, ".4f"), fmt(auc, ".4f"), fmt(share, ".0%"), fmt(a.samples_per_s, ",.0f"),
            fmt(a.mfu_e2e, ".1%"), _memory(a.memory), fmt(a.train_s_to_target, ".0f"),
            fmt(a.samples_to_target, ",.0f"),
            vs(a.train_s_to_target, ours.train_s_to_target if ours else None),
            fmt(a.startup_s, ".0f"), _compiling(a.compiling), fmt(a.steady_s_to_target, ".0f"),
            vs(a.steady_s_to_target, ours.steady_s_to_target if ours else None)]


def _memory(m: dict[str, float]) -> str:
    if "peak_memory_gb" not in m:
        return "-"
    kept = m.get("activations_kept_gb")
    return f"{m['peak_memory_gb']:.1f}" + (f" ({kept:.1f})" if kept is not None else "")


def _compiling(c: dict[str, float]) -> str:
    """Where the start-up went, from the run's compile timers ("-" in results without them;
    seconds over the whole run, evaluation's compiles included)."""
    if not c:
        return "-"
    return (f"{c.get('compile_s_torch', math.nan):.0f} / {c.get('compile_s_triton', math.nan):.0f}"
            f" ({c.get('triton_kernels_compiled', math.nan):.0f}) / "
            f"{c.get('tuning_s_gdpa', math.nan):.0f}")


def render(result: QualityResult, console=None) -> None:  # noqa: ANN001 (rich Console)
    """The arms side by side: final quality, speed, and time to the target NE."""
    from rich.console import Console
    from rich.table import Table

    from gem_platform.markup import escape_text as escape

    console = console or Console()
    target = ("no target (no arm evaluated)" if result.target_ne is None
              else f"target held-out CTR NE {result.target_ne:.4f} ({result.target_source})")
    ceiling = result.ceiling.get("ctr")
    console.print(escape(f"{result.recipe}: {target}"
                         + (f"; planted CTR ceiling AUC {ceiling:.4f}" if ceiling else "")))
    ours = next((a for a in result.arms if a.name == "ours" and not a.error), None)
    table = Table("", *[escape(a.name) for a in result.arms])
    cells = [_cells(a, ours, result.ceiling) for a in result.arms]
    for i, label in enumerate(ROWS):
        table.add_row(label, *[escape(c[i]) for c in cells])
    console.print(table)


def write(result: QualityResult, out: str | Path) -> Path:
    """JSON at ``out/quality_<recipe>_<attention>.json`` (folder created)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    attention = result.resolved_recipe.get("model", {}).get("attention", "")
    path = folder / f"quality_{result.recipe}_{attention}.json"
    data = asdict(result)
    for arm, row in zip(result.arms, data["arms"], strict=True):
        row |= {"startup_s": arm.startup_s, "steady_s_to_target": arm.steady_s_to_target}
    return write_json(path, data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="recipe YAML")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[],
                   help="override a recipe field (repeatable), e.g. train.steps=600")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="comma-separated arm names")
    p.add_argument("--target-ne", type=float, default=None,
                   help="held-out CTR NE to reach (default: the worst of the arms' best)")
    p.add_argument("--evals", type=int, default=10, help="held-out evaluations per arm")
    p.add_argument("--same-process", action="store_true",
                   help="train every arm in this process (default: each in a fresh one)")
    p.add_argument("--out", default="bench_results", help="folder for the JSON result")
    p.add_argument("--add-to", default=None,
                   help="an earlier result of the same recipe on this device to add arms to")
    args = p.parse_args(argv)
    try:
        if args.target_ne is not None and not 0 < args.target_ne < 10:
            raise GemError(f"--target-ne {args.target_ne} is no NE a run can reach.",
                           "Pass a held-out NE between 0 and 10, e.g. 0.9.")
        recipe = load_recipe(args.recipe, args.overrides)
        earlier = load_result(args.add_to) if args.add_to else None
        result = bench(recipe, args.arms.split(","), args.target_ne, args.evals,
                       isolate=not args.same_process,
                       on_arm=lambda partial: write(partial, args.out), earlier=earlier)
    except GemError as err:
        print(err.as_text(), file=sys.stderr)
        return 2
    render(result)
    print(f"quality: {write(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
