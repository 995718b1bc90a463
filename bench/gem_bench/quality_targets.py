"""gemctl bench quality-targets: one time-to-quality result read at several target NEs.

A build that compiles and autotunes longer but trains faster per sample is behind on an easy
target and ahead on a hard one; one target hides which. This reads a result that ``gemctl
bench quality`` wrote (no training) and gives, for each target, every arm's training seconds
and samples to it, and for each arm the run length beyond which ours has trained as many
samples in less time: the start-up difference over the per-sample time difference, from each
arm's start-up and steady samples/s.

    gemctl bench quality-targets docs/quality/quality_h200_gem.json
    gemctl bench quality-targets RESULT.json --target-ne 0.9 --target-ne 0.88 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

from gem_bench.quality import QualityArm, QualityResult, load_result, pick_target, reach
from gem_platform.errors import GemError


@dataclass(frozen=True)
class ArmAtTarget:
    """One arm's way to one target: the training seconds and samples it took."""

    arm: str
    train_s: float | None  # None: the arm's curve never reached the target
    samples: float | None
    vs_ours: float | None  # this arm's seconds over ours; > 1: ours got there sooner


def default_targets(result: QualityResult) -> list[float]:
    """The result's own target and the worst of the arms' best NEs (each arm reached it)."""
    worst_best, _ = pick_target(result.arms, None)
    return sorted({t for t in (result.target_ne, worst_best) if t is not None}, reverse=True)


def at_target(result: QualityResult, target: float) -> list[ArmAtTarget]:
    """Every finished arm's training seconds and samples to ``target``, and its ratio to ours."""
    arms = [a for a in result.arms if a.error is None]
    hits = {a.name: reach(a, target) for a in arms}
    ours_s = hits.get("ours", (None, None))[0]
    return [ArmAtTarget(a.name, *hits[a.name],
                        hits[a.name][0] / ours_s if hits[a.name][0] and ours_s else None)
            for a in arms]


def break_even_samples(ours: QualityArm, other: QualityArm) -> float | None:
    """Samples after which ours has trained as many as ``other`` in less time, with training
    time modelled as start-up + samples / steady samples/s: 0 where ours is ahead from the
    start, None where it never is (no faster per sample) or a figure is missing."""
    figures = (ours.startup_s, other.startup_s, ours.samples_per_s, other.samples_per_s)
    if any(math.isnan(x) for x in figures) or min(figures[2:]) <= 0:
        return None
    per_sample_gain = 1 / other.samples_per_s - 1 / ours.samples_per_s
    start_cost = ours.startup_s - other.startup_s
    if per_sample_gain <= 0:
        return None
    return max(start_cost / per_sample_gain, 0.0)


def view(result: QualityResult, targets: list[float]) -> dict:
    """Rows per target and the break-even run length of ours against each other arm."""
    ours = next((a for a in result.arms if a.name == "ours" and a.error is None), None)
    others = [a for a in result.arms if a.error is None and a is not ours]
    return {
        "recipe": result.recipe,
        "device": result.environment.get("device"),
        "targets": {f"{t:.4f}": [vars(row) for row in at_target(result, t)] for t in targets},
        "arms": {a.name: {"startup_s": _finite(a.startup_s),
                          "samples_per_s": _finite(a.samples_per_s)}
                 for a in result.arms if a.error is None},
        "ours_ahead_beyond_samples": {a.name: break_even_samples(ours, a) for a in others}
        if ours else {},
    }


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x


def render(data: dict, console=None) -> None:  # noqa: ANN001 (rich Console)
    from rich.console import Console
    from rich.table import Table

    from gem_platform.markup import escape_text as escape

    console = console or Console()
    names = list(data["arms"])
    table = Table("target NE", *[escape(n) for n in names],
                  title=escape(f"{data['recipe']} on {data['device']}: training seconds "
                               "(samples) to each held-out CTR NE; x: over ours"))
    for target, rows in data["targets"].items():
        by_arm = {r["arm"]: r for r in rows}
        table.add_row(target, *[_cell(by_arm[n]) for n in names])
    console.print(table)
    for name, samples in data["ours_ahead_beyond_samples"].items():
        arm, ours = data["arms"][name], data["arms"]["ours"]
        if None in (*arm.values(), *ours.values()):
            console.print(escape(f"ours against {name}: unknown (a start-up or samples/s is "
                                 "missing from the result)"))
            continue
        when = ("never (not faster per sample)" if samples is None
                else f"beyond {samples:,.0f} samples")
        console.print(escape(f"ours ahead of {name} {when}: start-up {ours['startup_s']:.0f} s "
                             f"against {arm['startup_s']:.0f} s, {ours['samples_per_s']:,.0f} "
                             f"against {arm['samples_per_s']:,.0f} samples/s"))


def _cell(row: dict) -> str:
    if row["train_s"] is None:
        return "never"
    ratio = f", {row['vs_ours']:.2f}x" if row["vs_ours"] and row["arm"] != "ours" else ""
    return f"{row['train_s']:.0f} s ({row['samples']:,.0f}){ratio}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="a quality_*.json that gemctl bench quality wrote")
    p.add_argument("--target-ne", type=float, action="append", default=None,
                   help="held-out CTR NE (repeatable; default: the result's target and the "
                        "worst of the arms' best)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    try:
        bad = [t for t in args.target_ne or [] if not 0 < t < 10]
        if bad:
            raise GemError(f"--target-ne {bad[0]} is no NE a run can reach.",
                           "Pass held-out NEs between 0 and 10, e.g. 0.9.")
        result = load_result(args.result, option="result")
        data = view(result, sorted(set(args.target_ne), reverse=True) if args.target_ne
                    else default_targets(result))
    except GemError as err:
        print(err.as_text(), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        render(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
