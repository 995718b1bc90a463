"""Regression gates as tests on the interval, one verdict per (arm, metric).

A gate bounds how much worse an arm may be than the baseline. With the 95% interval of the
paired difference (Welch's where seeds can't be paired), expressed as a regression (positive =
worse):

- pass: the whole interval lies within the limit (its worst end <= limit);
- fail: the whole interval lies beyond it (its best end > limit);
- inconclusive: the interval straddles the limit, or there is no interval (one seed). The
  verdict then says how many seeds the observed spread would need to settle it, if the mean
  and spread stayed as they are, and, where the runs recorded their wall time (in-process
  sweeps), what the missing trials would cost at the pace these ones trained. More seeds move
  the mean by about a standard error, so it also says how many a mean one standard error
  closer to the limit would need: near the limit the first count is fragile, and the second
  says how far it may grow.

A gate is never dropped because its metric can't be measured. Where a run of the arm or of the
baseline holds NaN, an infinity or no value at all for the gated metric (a diverged model; an
eval split without positives, whose NE a run does not record), the verdict names the arm, the
seeds and the values: fail when the arm's value is not finite where the baseline's is (the
arm broke), inconclusive otherwise (nothing to compare).

A QPS gate is inconclusive where the arm's or the baseline's trials trained several at once on
one machine (an in-process sweep's ``--parallel``): their QPS is a share of that machine.

A quality gate that would pass is inconclusive where the data plants a term of its own world
(long_range, lookback, recall: the attention ablation's controls) and the baseline's mean AUC
on that task is not above what a model blind to the term reaches (the runs record that
ceiling): an arm that cannot see the term, block-local attention there, would pass as well, so
the pass says nothing about it. A fail stands: the arm is worse whatever the baseline learned.

Gates that have no arm but the baseline to judge (every other arm's runs unfinished, or a
comparison narrowed to the baseline) give one inconclusive verdict saying so, and so does an
arm that a compared sweep or results file names but holds no finished run of (its runs failed,
or the sweep was cut short before them; the baseline included): gates never pass by omission.

A control expects its verdicts (``Expectation``): block-local attention on data that plants a
long-range term must FAIL there and PASS on a task without it. Such a verdict is marked: it
counts as a pass when it is the one expected (the control holds), as a fail when it is the
opposite (the control is broken: the gate can't be trusted to see what the ablation changes),
and as inconclusive otherwise, or when no gate judged it.

A pipeline reads the verdicts by exit code (``EXIT_CODES``) or from ``gemctl compare --json``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from gem_platform.data.ceilings import BLIND_AUC_METRIC
from gem_platform.errors import GemError
from gem_platform.sweep.results import CONCURRENT_TRIALS, TRIAL_WALL_S
from gem_platform.sweep.stats import Delta, seeds_to_settle, seeds_to_settle_closer


class GatedArm(Protocol):
    """What a gate reads of one arm of a comparison (compare.ArmResult)."""

    arm: str
    seeds: Sequence[str]
    deltas: Mapping[str, Delta]
    per_seed: Mapping[str, Sequence[float | None]]


class GatedComparison(Protocol):
    """What the gates read of a comparison (compare.Comparison), so this module needs nothing
    from compare, which applies the gates."""

    baseline: str
    tasks: Sequence[str]
    # arms the compared sources name but hold no finished run of -> why (e.g. its runs failed)
    unfinished: Mapping[str, str]

    @property
    def arms(self) -> Sequence[GatedArm]: ...


PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
VerdictWord = Literal["pass", "fail", "inconclusive"]

# The tasks every run evaluates (data.batch.TASKS): gated when no run recorded any task.
DEFAULT_TASKS = ("ctr", "cvr")
# Exit codes of `gemctl compare` with gates; 2 is bad input (every gemctl command).
EXIT_PASS, EXIT_FAIL, EXIT_INCONCLUSIVE = 0, 1, 3
EXIT_CODES = {EXIT_PASS: "every gate passed (or none was set)",
              EXIT_FAIL: "a gate failed: an interval lies wholly beyond its limit",
              2: "bad input (a missing or malformed file, id or option)",
              EXIT_INCONCLUSIVE: "no gate failed, but at least one is inconclusive: an interval "
                                 "straddles its limit, or an arm ran one seed"}


@dataclass(frozen=True)
class Expectation:
    """The verdict a control's arm must get on one gated metric (``eval/ne_ctr``, ...)."""

    arm: str
    metric: str
    verdict: Literal["pass", "fail"]

    @classmethod
    def of(cls, arm: str, metric: str, verdict: Literal["pass", "fail"]) -> Expectation:
        """A metric without a slash is an eval metric: ne_ctr is eval/ne_ctr."""
        return cls(arm, metric if "/" in metric else f"eval/{metric}", verdict)

    @classmethod
    def parse(cls, text: str) -> Expectation:
        """``ARM:METRIC=pass|fail``, e.g. ``block64:ne_ctr=fail``."""
        arm, _, rest = text.rpartition(":")
        metric, _, word = rest.partition("=")
        if not arm or not metric or word.lower() not in (PASS, FAIL):
            raise GemError(f"--expect {text[:100]!r} is not ARM:METRIC=pass|fail.",
                           "Pass e.g. --expect block64:ne_ctr=fail --expect block64:ne_cvr=pass.")
        return cls.of(arm, metric, word.lower())


@dataclass(frozen=True)
class Gates:
    """Limits per arm vs the baseline (None = not checked), and what controls expect."""

    max_ne_regression_pct: float | None = None
    max_auc_drop: float | None = None
    max_qps_drop_pct: float | None = None
    expect: tuple[Expectation, ...] = ()

    def any(self) -> bool:
        """Whether any limit is set (expectations alone judge nothing)."""
        return any(v is not None for v in (self.max_ne_regression_pct, self.max_auc_drop,
                                           self.max_qps_drop_pct))


@dataclass(frozen=True)
class Verdict:
    """One gate on one arm's metric. ``regression``/``low``/``high``: the difference turned
    so that positive is worse (NE up, AUC or QPS down), in the gate's unit; ``seeds_needed``:
    seeds per arm that would settle an inconclusive verdict (None: settled, or unknowable)."""

    arm: str
    metric: str
    verdict: VerdictWord
    regression: float
    low: float
    high: float
    limit: float
    unit: str
    seeds: int
    seeds_needed: int | None
    message: str
    # ``seeds_needed`` had the mean sat one standard error closer to the limit (None: that
    # step reaches the limit, or no seeds are asked): how far the ask can grow as seeds come
    seeds_needed_closer: int | None = None
    # the runs whose value is NaN, infinite or missing, in words (None: every value finite)
    unmeasured: str | None = None
    # for a speed gate: the arms whose trials shared a machine, in words (None: each alone)
    shared: str | None = None
    # for a quality gate: why the baseline can't yet show what blindness to the world's own
    # term costs, in words (None: it learned the term, or the data has none)
    unlearned: str | None = None
    # why the gate judged nothing, in words: no arm besides the baseline, or none of this
    # arm's runs finished (None: it judged a difference)
    unjudged: str | None = None
    # the verdict a control expects here (None: not a control's)
    expected: str | None = None
    # the trials ``seeds_needed`` asks beyond those run (both arms) and the machine hours they
    # would take at these trials' pace (None: settled, or no wall time recorded)
    settle_cost: tuple[int, float] | None = None


def judge(arm: str, metric: str, delta: Delta, limit: float, worse_if: Literal[1, -1],
          unit: str, label: str, option: str) -> Verdict:
    """The verdict of one gate on ``delta`` (arm - baseline)."""
    if worse_if == 1:
        reg, low, high = delta.value, delta.low, delta.high
    else:
        reg, low, high = -delta.value, -delta.high, -delta.low
    digits = 4 if unit == "" else 3
    shown = f"{label} regression {reg:+.{digits}f}{unit}"
    if math.isfinite(low) and math.isfinite(high):
        shown += f" [95% CI {low:+.{digits}f}, {high:+.{digits}f}]"
    bound = f"{option} {limit:g}{unit}"
    needed = closer = None
    if math.isfinite(low) and high <= limit:
        word: VerdictWord = PASS
        why = f"within {bound}"
    elif math.isfinite(low) and low > limit:
        word = FAIL
        why = f"wholly beyond {bound}"
    else:
        word = INCONCLUSIVE
        needed = seeds_to_settle(reg, delta.sd, limit)
        closer = seeds_to_settle_closer(reg, delta.sd, delta.n, limit) if needed else None
        if not math.isfinite(low):
            why = (f"no interval from {delta.n} seed(s) of this arm against the baseline; "
                   "run at least 2 seeds per arm")
        else:
            why = f"the interval straddles {bound}" + (
                _seeds_words(needed, closer, delta.sd / math.sqrt(delta.n), digits, unit)
                if needed else "; the mean sits on the limit, more seeds may not settle it")
    return Verdict(arm, metric, word, reg, low, high, limit, unit, delta.n, needed,
                   f"arm '{arm}': {shown}: {word.upper()}, {why}", seeds_needed_closer=closer)


def _seeds_words(needed: int, closer: int | None, se: float, digits: int, unit: str) -> str:
    """The seeds an inconclusive gate asks, and how far the ask grows if the mean, which more
    seeds move by about a standard error, moves that much toward the limit."""
    step = f"one standard error ({se:.{digits}f}{unit}) toward the limit"
    return (f"; about {needed} seeds per arm would settle it at this spread if the mean held"
            + (f", about {closer} if it moved {step}" if closer else
               f"; moved {step}, it would sit on the limit, where no count of seeds is sure "
               "to settle it"))


def _gate_checks(tasks: Sequence[str], gates: Gates
                 ) -> list[tuple[str, float, Literal[1, -1], str, str, str]]:
    """(metric, limit, direction, unit, label, option) of every gate that is set."""
    checks: list[tuple[str, float | None, Literal[1, -1], str, str, str]] = []
    for task in tasks or DEFAULT_TASKS:
        checks.append((f"eval/ne_{task}", gates.max_ne_regression_pct, 1, "%", f"NE {task}",
                       "--max-ne-regression"))
        checks.append((f"eval/auc_{task}", gates.max_auc_drop, -1, "", f"AUC {task}",
                       "--max-auc-drop"))
    checks.append(("perf/qps", gates.max_qps_drop_pct, -1, "%", "QPS", "--max-qps-drop"))
    return [(m, limit, w, u, lab, o) for m, limit, w, u, lab, o in checks if limit is not None]


def _value_word(value: float | None) -> str | None:
    """'missing', 'nan', 'inf' or '-inf' for a value no gate can use; None for a finite one."""
    if value is None:
        return "missing"
    return None if math.isfinite(value) else str(float(value))


def _unusable(res: GatedArm, metric: str) -> dict[str, str]:
    """seed -> 'missing' / 'nan' / 'inf' for the runs of ``res`` without a finite ``metric``."""
    values = list(res.per_seed.get(metric) or [])
    values += [None] * (len(res.seeds) - len(values))
    return {seed: word for seed, v in zip(res.seeds, values, strict=False)
            if (word := _value_word(v)) is not None}


def _listed(words: Mapping[str, str]) -> str:
    return ", ".join(f"seed {seed}: {word}" for seed, word in words.items())


def judge_unmeasured(res: GatedArm, base: GatedArm | None, metric: str, limit: float,
                     unit: str, label: str, option: str) -> Verdict | None:
    """The verdict of a gate some of whose runs lack a finite value (None when all have one):
    FAIL where the arm's value is NaN or infinite and the baseline's in the same seed is
    finite, else INCONCLUSIVE; the message names the arm, the seeds and the values."""
    arm_bad = _unusable(res, metric)
    base_bad = _unusable(base, metric) if base is not None else {}
    if not arm_bad and not base_bad:
        return None
    base_seeds = set(base.seeds) if base is not None else set()
    broke = {s: w for s, w in arm_bad.items()
             if w != "missing" and s in base_seeds and s not in base_bad}
    parts = []
    if arm_bad:
        parts.append(f"arm '{res.arm}' {_listed(arm_bad)}")
    if base_bad:
        parts.append(f"baseline '{base.arm}' {_listed(base_bad)}")  # type: ignore[union-attr]
    unmeasured = "; ".join(parts)
    if broke:
        word: VerdictWord = FAIL
        why = (f"the arm's {label} is not finite ({_listed(broke)}) where the baseline's is: "
               "the arm diverged or broke its evaluation")
    else:
        word = INCONCLUSIVE
        why = (f"{label} can't be compared: a run records no value it could not compute (an "
               "eval split without positives, a diverged model); rerun those seeds or fix "
               "their data")
    finite = len(res.seeds) - len(arm_bad)
    return Verdict(res.arm, metric, word, math.nan, math.nan, math.nan, limit, unit, finite,
                   None, f"arm '{res.arm}': {label} is not finite in every run "
                   f"({unmeasured}): {word.upper()}, {why} ({option} {limit:g}{unit})",
                   unmeasured)


def _pace(arm: GatedArm) -> float | None:
    """The median machine seconds of one of ``arm``'s trials: its wall time over the trials it
    shared the machine with; None where no run recorded its wall time."""
    walls = arm.per_seed.get(TRIAL_WALL_S) or []
    shared = arm.per_seed.get(CONCURRENT_TRIALS) or [None] * len(walls)
    paces = sorted(w / (c or 1.0) for w, c in zip(walls, shared, strict=True) if w is not None)
    return paces[len(paces) // 2] if paces else None


def settle_cost(res: GatedArm, base: GatedArm, needed: int) -> tuple[int, float] | None:
    """The trials that ``needed`` seeds per arm add to ``res`` and ``base``, and the machine
    hours they take, each arm's at its own pace (``_pace``: an FP8 arm's trials may take twice
    the baseline's; an arm with none recorded takes the other's); None where neither has."""
    paces = {arm.arm: _pace(arm) for arm in (res, base)}
    known = [p for p in paces.values() if p is not None]
    if not known:
        return None
    more = {arm.arm: max(needed - len(arm.seeds), 0) for arm in (res, base)}
    seconds = sum(n * (paces[a] if paces[a] is not None else known[0]) for a, n in more.items())
    return sum(more.values()), seconds / 3600


def seeds_asked(v: Verdict) -> str:
    """'~36 seeds (~147 if the mean moves 1 SE closer)': an inconclusive verdict's ask for a
    table cell, with how far it grows if the mean moves one standard error toward the limit."""
    closer = f"~{v.seeds_needed_closer}" if v.seeds_needed_closer else "no sure count"
    return f"~{v.seeds_needed} seeds ({closer} if the mean moves 1 SE closer)"


def settle_words(v: Verdict) -> str:
    """``seeds_asked`` and, where known, what those seeds cost: the "to settle" text of an
    inconclusive verdict in the table and the Markdown report."""
    asked = seeds_asked(v)
    return asked if v.settle_cost is None else f"{asked}: {cost_words(v.settle_cost)}"


def cost_words(cost: tuple[int, float]) -> str:
    """``settle_cost``'s trials and machine time in words: minutes under an hour."""
    more, hours = cost
    return f"{more} more trials, ~" + (f"{hours * 60:.0f} min" if hours < 1 else
                                       f"{hours:.1f} h")


# An ask for seeds invites reading the gate again after each batch, and each look is another
# chance for the interval to clear the limit by luck.
LOOKS_ADVICE = (". Fix the count before running them: a gate read again after each batch passes "
                "by luck more often (`gemctl bench looks` reads it at the level for all its "
                "looks)")


def with_cost(verdict: Verdict, res: GatedArm, base: GatedArm | None) -> Verdict:
    """``verdict`` with what its ``seeds_needed`` would cost (``settle_cost``), in its fields
    and its message where the runs recorded their wall time, and, where it asks seeds, the
    advice to fix their count in advance."""
    if not verdict.seeds_needed:
        return verdict
    cost = settle_cost(res, base, verdict.seeds_needed) if base is not None else None
    priced = (f"; {verdict.seeds_needed} seeds: {cost_words(cost)} of machine time at these "
              "trials' pace") if cost else ""
    return replace(verdict, settle_cost=cost, message=verdict.message + priced + LOOKS_ADVICE)


def sharing(res: GatedArm) -> int:
    """The most trials any run of ``res`` trained beside (itself included): above 1 its QPS
    is a share of a machine, not a speed figure; 1 where no run recorded it."""
    values = [v for v in res.per_seed.get(CONCURRENT_TRIALS) or [] if v is not None]
    return int(max(values, default=1))


def judge_shared(res: GatedArm, base: GatedArm | None, limit: float, option: str
                 ) -> Verdict | None:
    """INCONCLUSIVE for a QPS gate whose arm or baseline trained several trials at once on one
    machine (their QPS is a share of it); None when both trained alone."""
    shared = {a.arm: n for a in (res, base) if a is not None and (n := sharing(a)) > 1}
    if not shared:
        return None
    listed = ", ".join(f"'{arm}' {n} at a time" for arm, n in shared.items())
    return Verdict(res.arm, "perf/qps", INCONCLUSIVE, math.nan, math.nan, math.nan, limit,
                   "%", 0, None,
                   f"arm '{res.arm}': QPS: INCONCLUSIVE, trials shared one machine ({listed}): "
                   f"their QPS is a share of it, not a speed figure ({option} {limit:g}%); "
                   "gate speed on trials trained one at a time (--parallel 1)",
                   shared=f"trained {listed}")


def _finite(values: Sequence[float | None] | None) -> list[float]:
    return [v for v in values or [] if v is not None and math.isfinite(v)]


def blind_baseline(base: GatedArm | None, task: str) -> str | None:
    """Why ``base`` can't yet show what blindness to its data's world term costs on ``task``,
    in words: its mean AUC is not above the ceiling of a model blind to the term. None where
    it is above, or where the runs record no such ceiling (data without a world term)."""
    if base is None:
        return None
    ceilings = _finite(base.per_seed.get(BLIND_AUC_METRIC.format(task=task)))
    aucs = _finite(base.per_seed.get(f"eval/auc_{task}"))
    if not ceilings or not aucs:
        return None
    blind, auc = max(ceilings), sum(aucs) / len(aucs)
    if auc > blind:
        return None
    return (f"baseline '{base.arm}' AUC {task} {auc:.4f} is not above {blind:.4f}, what a "
            "model blind to the data's world term reaches")


def judge_unlearned(verdict: Verdict, base: GatedArm | None) -> Verdict:
    """``verdict`` where the task's baseline learned the data's world term (or the data has
    none); where it has not (blind_baseline), a PASS becomes INCONCLUSIVE, and an INCONCLUSIVE
    verdict says that more seeds can settle only a FAIL (a pass would be held as well)."""
    if verdict.verdict == FAIL or not verdict.metric.startswith("eval/"):
        return verdict
    why = blind_baseline(base, verdict.metric.removeprefix("eval/").partition("_")[2])
    if why is None:
        return verdict
    if verdict.verdict == INCONCLUSIVE:
        return replace(verdict, unlearned=why, message=verdict.message +
                       f"; but {why}, so more seeds can settle a FAIL, never a pass, until "
                       "the baseline learns the term")
    return replace(verdict, verdict=INCONCLUSIVE, seeds_needed=None, unlearned=why,
                   message=verdict.message.replace(": PASS,", ": INCONCLUSIVE,", 1) +
                   f", but {why}, so an arm blind to the term would pass too; train the "
                   "baseline until it learns the term (more steps or samples), then compare")


def check_gates(cmp: GatedComparison, gates: Gates) -> list[Verdict]:
    """A verdict per gated (arm, metric), arms in the comparison's order; a gate whose metric
    is not finite in some run gets a FAIL or INCONCLUSIVE verdict that says so, and so does
    an arm without a finished run, or a comparison with no arm but the baseline."""
    if not gates.any():
        return []
    unfinished = [arm_without_runs(arm, why) for arm, why in cmp.unfinished.items()]
    if all(res.arm == cmp.baseline for res in cmp.arms):
        return unfinished or [nothing_judged(cmp.baseline)]
    base = next((res for res in cmp.arms if res.arm == cmp.baseline), None)
    out: list[Verdict] = []
    for res in cmp.arms:
        if res.arm == cmp.baseline:
            continue
        for metric, limit, worse_if, unit, label, option in _gate_checks(cmp.tasks, gates):
            verdict = (judge_shared(res, base, limit, option) if metric == "perf/qps" else
                       None) or judge_unmeasured(res, base, metric, limit, unit, label, option)
            delta = res.deltas.get(metric)
            if verdict is not None:
                out.append(verdict)
            elif delta is None or not math.isfinite(delta.value):  # e.g. a baseline mean of 0
                out.append(Verdict(res.arm, metric, INCONCLUSIVE, math.nan, math.nan, math.nan,
                                   limit, unit, 0, None,
                                   f"arm '{res.arm}': {label}: INCONCLUSIVE, no finite "
                                   f"difference to the baseline ({option} {limit:g}{unit})",
                                   "no finite difference to the baseline"))
            else:
                out.append(with_cost(judge_unlearned(judge(res.arm, metric, delta, limit,
                                                           worse_if, unit, label, option),
                                                     base), res, base))
    return out + unfinished


def nothing_judged(baseline: str) -> Verdict:
    """The verdict of gates that had no arm but the baseline to judge (its rivals' runs all
    unfinished, or a comparison narrowed to it): inconclusive, never a pass."""
    why = f"no arm besides the baseline '{baseline}' has a finished run to judge"
    return Verdict("-", "-", INCONCLUSIVE, math.nan, math.nan, math.nan, math.nan, "", 0, None,
                   f"{why}: the gates judged nothing (INCONCLUSIVE). Compare runs that hold "
                   "another arm; unfinished runs are left out.", unjudged=why)


def arm_without_runs(arm: str, why: str) -> Verdict:
    """The verdict of gates on an arm the compared sweeps or files name but hold no finished
    run of (``why``: e.g. its runs failed): inconclusive, never a pass by omission."""
    return Verdict(arm, "-", INCONCLUSIVE, math.nan, math.nan, math.nan, math.nan, "", 0, None,
                   f"arm '{arm}': no finished run to judge ({why}): INCONCLUSIVE. Finish its "
                   "runs (the same sweep command resumes them) or leave it out with --arms.",
                   unjudged=f"no finished run of arm '{arm}'")


def expect_verdicts(verdicts: list[Verdict], expectations: Sequence[Expectation]
                    ) -> list[Verdict]:
    """The verdicts with each control's expectation marked and told in the message, plus an
    inconclusive verdict for each expectation no gate judged (never a pass by omission)."""
    wanted = {(e.arm, e.metric): e.verdict for e in expectations}
    out = []
    for v in verdicts:
        want = wanted.pop((v.arm, v.metric), None)
        if want is None:
            out.append(v)
            continue
        held = ("it holds" if v.verdict == want else "not settled" if v.verdict == INCONCLUSIVE
                else "it does not hold: the control is broken, so the ablation's verdicts "
                "say nothing yet")
        out.append(replace(v, expected=want,
                           message=f"{v.message}; the control expects {want.upper()}: {held}"))
    for (arm, metric), want in wanted.items():
        why = f"no gate judged {metric} of arm '{arm}'"
        out.append(Verdict(arm, metric, INCONCLUSIVE, math.nan, math.nan, math.nan, math.nan,
                           "", 0, None, f"arm '{arm}': the control expects {want.upper()} on "
                           f"{metric}, but {why}: INCONCLUSIVE. Set that metric's gate and "
                           "compare runs that hold the arm.", unjudged=why, expected=want))
    return out


def effective(v: Verdict) -> VerdictWord:
    """A verdict as the exit code counts it: a control's expected verdict passes, the
    opposite settled one fails."""
    if v.expected is None or v.verdict == INCONCLUSIVE:
        return v.verdict
    return PASS if v.verdict == v.expected else FAIL


def exit_code(verdicts: list[Verdict]) -> int:
    """1 if any gate failed, else 3 if any is inconclusive, else 0 (controls' verdicts counted
    as ``effective`` says)."""
    words = {effective(v) for v in verdicts}
    if FAIL in words:
        return EXIT_FAIL
    return EXIT_INCONCLUSIVE if INCONCLUSIVE in words else EXIT_PASS
