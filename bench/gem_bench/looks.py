"""gemctl bench looks: what a gate's verdict is worth after looking at it more than once.

`gemctl compare` reads each gate from a 95% interval, right for one look at a fixed number of
seeds. Adding seeds until the verdict settles looks several times, and each look is another
chance for the interval to clear the limit by luck: with a true regression exactly at the
limit, a PASS at 2.5% per look comes more often over several looks. This tool takes the seed
counts at which the gate was read (by default those the file's ``rounds`` record: the paired
counts after each call that trained into it; the last is the file's own) and reports, for one
arm and
NE metric of a results file (the gate's relative regression):

- how often looks at those counts give a false PASS (or FAIL) at 95% each, with the true
  regression at the limit;
- the one level for every look that holds that to 2.5% over those looks (as Pocock's
  group-sequential design; found by simulation, since the looks are wherever the seeds were
  added), and the gate's interval and verdict at that level;
- the same under Bonferroni (2.5% / looks per look), which holds for any looks and is the most
  conservative.

The t-statistic of a mean at the limit does not depend on the spread, so the boundary depends
only on the seed counts. A schedule chosen from earlier readings (seeds added because the
gate asked for them) is treated as fixed.

    gemctl bench looks docs/quality/ablation_precision_h200.json --arm fp8_b32 \\
        --metric ne_ctr --looks 5,8,20,23,30,35,37,40 --max-regression 0.2%
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from gem_platform.errors import GemError
from gem_platform.sweep.compare import compare_trials, only_arms, parse_percent
from gem_platform.sweep.gates import judge
from gem_platform.sweep.results import (
    TrialRun,
    cross_device_seeds,
    load_results,
    looks_of,
    rounds_of,
)
from gem_platform.sweep.stats import Delta, at_confidence, t_quantile

ALPHA = 0.025  # one side of the gate's 95% interval
DRAWS = 100_000
MAX_DRAWN = 20_000_000  # simulated per-seed differences (x 8 bytes, three arrays)


def _t_statistics(looks: list[int], draws: int, seed: int) -> np.ndarray:
    """t-statistics of the running mean at each look, for ``draws`` runs of standard normal
    per-seed differences (mean 0: the true regression at the limit)."""
    x = np.random.default_rng(seed).standard_normal((draws, max(looks)))
    sums, squares = np.cumsum(x, 1), np.cumsum(x * x, 1)
    out = []
    for n in looks:
        mean = sums[:, n - 1] / n
        sd = np.sqrt(np.maximum(squares[:, n - 1] - n * mean * mean, 0.0) / (n - 1))
        out.append(mean / (sd / np.sqrt(n)))
    return np.stack(out, 1)


def false_claim_rate(stats: np.ndarray, looks: list[int], level: float) -> float:
    """Share of simulated runs whose one-sided ``level`` interval clears the limit at any look
    (a PASS when the regression is exactly at the limit; a FAIL is the mirror image)."""
    bounds = np.array([t_quantile(level, n - 1) for n in looks])
    return float((stats < -bounds).any(1).mean())


def sequential_level(looks: list[int], draws: int = DRAWS, seed: int = 0) -> tuple[float, float]:
    """(one-sided level per look holding the false-claim rate to 2.5% over ``looks``, the rate
    of looks at 97.5% each). Seed counts below 2 have no interval and are left out."""
    looks = sorted({n for n in looks if n >= 2})
    if not looks:
        raise GemError("bench looks needs at least one look at 2 or more seeds.",
                       "List the seed counts at which the gate was read, e.g. --looks 8,20.")
    stats = _t_statistics(looks, max(10_000, min(draws, MAX_DRAWN // looks[-1])), seed)
    nominal = false_claim_rate(stats, looks, 1 - ALPHA)
    low, high = 1 - ALPHA, 1 - ALPHA / len(looks) / 4  # Bonferroni/4 is beyond any need
    for _ in range(25):
        mid = (low + high) / 2
        low, high = (mid, high) if false_claim_rate(stats, looks, mid) > ALPHA else (low, mid)
    return high, nominal


@dataclass(frozen=True)
class Reading:
    """The gate's interval for one arm and metric at one per-look level, and its verdict."""

    rule: str
    confidence: float  # two-sided, as the gate's 95%
    value: float  # the regression in % of the baseline's mean (the same at every level)
    low: float
    high: float
    verdict: str


def _reading(rule: str, level: float, gated: Delta, limit: float) -> Reading:
    """The gate's own delta read at ``level`` (one-sided) and judged as the gate judges."""
    d = at_confidence(gated, 2 * level - 1)
    verdict = judge("", "", d, limit, 1, "%", "NE", "--max-regression").verdict.upper()
    return Reading(rule, 2 * level - 1, d.value, d.low, d.high, verdict)


def _gated(path: str, trials: list[TrialRun], arm: str, baseline: str, metric: str
           ) -> tuple[Delta, list[str]]:
    """The gate's delta of ``arm`` against ``baseline`` on ``metric`` (as `gemctl compare`
    computes it, in % of the baseline) and the seeds it may pair (not trained apart)."""
    key = metric if "/" in metric else f"eval/{metric}"
    if not key.startswith("eval/ne_"):
        raise GemError(f"bench looks reads NE gates (a regression in % of the baseline); "
                       f"got --metric {metric}.", "Pass --metric ne_ctr or another task's NE.")
    if arm == baseline:
        raise GemError(f"--arm {arm} is the baseline; its gate has nothing to compare.",
                       "Name a gated arm (gemctl compare FILE lists them).")
    cmp = compare_trials(only_arms(trials, [arm], baseline), baseline)
    res = next((r for r in cmp.arms if r.arm == arm), None)
    d = res.deltas.get(key) if res is not None else None
    if d is None or d.method != "paired" or d.n < 2:
        raise GemError(f"{path}: arm {arm!r} does not pair 2 or more seeds with {baseline!r} on "
                       f"{key}; a gate read at several looks needs a paired interval.",
                       "Name an arm and metric the file holds (gemctl compare FILE lists them).")
    base = next(r for r in cmp.arms if r.arm == baseline)
    return d, sorted(set(res.seeds) - set(cross_device_seeds(res.devices, base.devices)))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemctl bench looks", description=__doc__.split("\n")[0])
    p.add_argument("results")
    p.add_argument("--arm", required=True)
    p.add_argument("--baseline", default=None)
    p.add_argument("--metric", default="ne_ctr")
    p.add_argument("--looks", default=None,
                   help="earlier seed counts, comma-separated (default: the file's rounds)")
    p.add_argument("--max-regression", default="0.2%")
    p.add_argument("--out", default="bench_results")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    trials, header = load_results(args.results)
    baseline = args.baseline or header.get("baseline")
    limit = parse_percent(args.max_regression)
    gated, seeds = _gated(args.results, trials, args.arm, baseline, args.metric)
    if args.looks is None:
        earlier = looks_of(rounds_of(header, trials), args.arm, baseline, seeds)
    else:
        try:
            earlier = [int(x) for x in args.looks.split(",") if x.strip()]
        except ValueError:
            raise GemError(f"--looks {args.looks!r} is not a comma-separated list of seed "
                           "counts.", "Write e.g. --looks 5,8,20.") from None
    looks = sorted({n for n in earlier if 2 <= n < gated.n} | {gated.n})
    level, nominal = sequential_level(looks)
    readings = [_reading(rule, lv, gated, limit) for rule, lv in (
        ("one look (the gate)", 1 - ALPHA), (f"{len(looks)} looks, one level for all", level),
        (f"{len(looks)} looks, Bonferroni", 1 - ALPHA / len(looks)))]
    _show(args, baseline, looks, nominal, readings)
    if args.looks is None and len(looks) == 1 and "rounds" not in header:
        Console().print("the file records no rounds (written before they were): pass the seed "
                        "counts at which its gate was read as --looks")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "looks_bench.json").write_text(json.dumps({
        "results": args.results, "arm": args.arm, "baseline": baseline, "metric": args.metric,
        "limit_percent": limit, "looks": looks, "false_claim_rate_at_95": nominal,
        "readings": [asdict(r) for r in readings]}, indent=2) + "\n")
    return 0


def _show(args: argparse.Namespace, baseline: str, looks: list[int], nominal: float,
          readings: list[Reading]) -> None:
    console = Console()
    console.print(f"{args.arm} vs {baseline}, {args.metric}, limit {args.max_regression}; "
                  f"looks at {', '.join(map(str, looks))} seeds: a true regression at the "
                  f"limit passes at one of them {nominal:.1%} of the time at 95% each "
                  f"(2.5% for one look)")
    table = Table("rule", "interval", "regression % [CI]", "verdict")
    for r in readings:
        table.add_row(r.rule, f"{r.confidence:.2%}",
                      f"{r.value:+.3f}% [{r.low:+.3f}, {r.high:+.3f}]", r.verdict)
    console.print(table)


if __name__ == "__main__":
    raise SystemExit(main())
