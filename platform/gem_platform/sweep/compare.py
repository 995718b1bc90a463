"""Compare the arms of one or more sweeps (or hand-picked runs): quality per task as mean +-
std over seeds with the delta to the baseline arm and its confidence interval, efficiency
(QPS, MFU, padding waste, straggler overhead), and the regression gates a scheduled pipeline
fails on."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gem_platform.data.ceilings import BLIND_AUC_METRIC
from gem_platform.provenance import TAG_COMMIT, TAG_DEVICE
from gem_platform.sweep import store
from gem_platform.sweep.config import SweepError
from gem_platform.sweep.gates import (
    FAIL,
    Gates,
    Verdict,
    check_gates,
    exit_code,
    expect_verdicts,
)
from gem_platform.sweep.results import (
    COMPARISON_FORMAT,
    CONCURRENT_TRIALS,
    TRIAL_WALL_S,
    TrialRun,
    cross_device_seeds,
    is_results_file,
    load_results,
    seed_devices,
)
from gem_platform.sweep.stats import (
    Delta,
    Summary,
    paired_delta,
    relative,
    summarize,
    welch_delta,
)
from gem_platform.train.learning import TRAINED_EPOCHS

if TYPE_CHECKING:  # MLflow loads only when tracked runs are collected
    from mlflow.entities import Run

QUALITY = ("ne", "auc", "calibration")
EFFICIENCY = {
    "perf/qps": "QPS",
    "perf/mfu_e2e": "MFU E2E",
    "balance/padding_waste_mean": "padding waste",
    "balance/straggler_overhead_mean": "straggler overhead",
}


@dataclass
class ArmResult:
    arm: str
    run_ids: list[str]
    seeds: list[str]
    metrics: dict[str, Summary] = field(default_factory=dict)
    # metric -> delta to the baseline; NE and QPS in percent of the baseline, others absolute
    deltas: dict[str, Delta] = field(default_factory=dict)
    # metric -> its value in each run, in the order of ``seeds`` / ``run_ids`` (None where a
    # run lacks it): the samples behind each summary, from which a comparison's JSON is read
    # back
    per_seed: dict[str, list[float | None]] = field(default_factory=dict)
    # seed -> the code (git commit) its run trained with, where recorded
    commits: dict[str, str] = field(default_factory=dict)
    # seed -> the device its run trained on, where recorded
    devices: dict[str, str] = field(default_factory=dict)


@dataclass
class Comparison:
    baseline: str
    tasks: list[str]
    arms: list[ArmResult]
    sweep_ids: list[str]
    parent_run_ids: list[str]
    skipped: list[str] = field(default_factory=list)  # unfinished runs left out
    verdicts: list[Verdict] = field(default_factory=list)
    # arms the compared sources name but hold no finished run of -> why
    unfinished: dict[str, str] = field(default_factory=dict)

    @property
    def failures(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.verdict == FAIL]

    @property
    def past_one_epoch(self) -> dict[str, float]:
        """Arms with a run that trained past one epoch of its training split -> the most
        epochs any of them took (runs that recorded it): their NE can measure memorization."""
        out = {}
        for arm in self.arms:
            epochs = [e for e in arm.per_seed.get(TRAINED_EPOCHS) or []
                      if isinstance(e, int | float) and e > 1.0]
            if epochs:
                out[arm.arm] = max(epochs)
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``gemctl compare --json``); ``results.load_results`` reads it back.
        Strict JSON: a run's non-finite value is the string "nan" / "inf" / "-inf", any other
        non-finite number null."""

        def clean(obj: Any) -> Any:
            if isinstance(obj, float):
                return obj if math.isfinite(obj) else None
            if isinstance(obj, dict):
                return {k: clean(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [clean(v) for v in obj]
            return obj

        body = asdict(self)
        for arm in body["arms"]:  # a run's NaN or infinity stays readable (strict JSON)
            arm["per_seed"] = {k: [v if v is None or math.isfinite(v) else str(v) for v in vs]
                               for k, vs in arm["per_seed"].items()}
        return {"format": COMPARISON_FORMAT, **clean(body),
                "past_one_epoch": self.past_one_epoch, "exit_code": exit_code(self.verdicts)}


def parse_percent(text: str) -> float:
    """'0.1%' or '0.1' -> 0.1 (percent)."""
    raw = text.strip().removesuffix("%").strip()
    try:
        value = float(raw)
    except ValueError:
        raise SweepError(f"Gate value {text!r} is not a number.",
                         "Write a percentage such as 0.1% (or 0.1).") from None
    if value < 0 or not math.isfinite(value):
        raise SweepError(f"Gate value {text!r} must be a finite number >= 0.",
                         "Write a percentage such as 0.1%.")
    return value


def _as_trial(run: Run, sweep_id: str | None, parent: str | None) -> TrialRun:
    tags = run.data.tags
    return TrialRun(
        run_id=run.info.run_id,
        arm=tags.get(store.TAG_ARM) or tags.get(store.TAG_RUN_NAME) or run.info.run_id[:8],
        seed=tags.get(store.TAG_SEED, run.info.run_id[:8]),
        metrics=dict(run.data.metrics),
        sweep_id=sweep_id or tags.get(store.TAG_SWEEP),
        parent_run_id=parent or tags.get(store.TAG_PARENT),
        commit=tags.get(TAG_COMMIT),
        device=tags.get(TAG_DEVICE),
    )


@dataclass
class Collected:
    """What ``collect`` found: the finished trial runs, the sweeps' own baseline arms in order,
    the ids of unfinished runs left out, the tasks saved comparisons declare, per arm the
    sources name, where it was named (an arm with no finished run is one a gate can't
    judge), and per arm its recipe's fingerprint with the first source that gave it."""

    trials: list[TrialRun] = field(default_factory=list)
    baselines: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    named: dict[str, str] = field(default_factory=dict)
    recipes: dict[str, tuple[Any, str]] = field(default_factory=dict)


def _check_same_recipes(seen: dict[str, tuple[Any, str]], recipes: Any, source: str) -> None:
    """Sources compared together must mean one recipe by one arm name: their runs are pooled
    by arm and paired by seed, so two recipes under one name would be judged as one.
    ``recipes``: arm -> what identifies its recipe in ``source``."""
    for arm, identity in (recipes.items() if isinstance(recipes, dict) else ()):
        first, where = seen.setdefault(store.arm_key(str(arm)), (identity, source))
        if first != identity:
            raise SweepError(
                f"Arm {arm!r} is one recipe in {where} and another in {source}: compared "
                "together, their runs would be pooled and judged as one arm.",
                "Compare them apart, or give the arm another name in one sweep's spec.")


def _collect_files(files: list[str], trials: dict[str, TrialRun], got: Collected) -> None:
    """The trials of results files (and saved comparisons), their baselines, tasks and arms."""
    for ident in files:
        runs_in_file, header = load_results(ident)
        _check_same_recipes(got.recipes, header.get("recipes"), ident)
        trials.update((t.run_id, t) for t in runs_in_file)
        got.baselines += [header["baseline"]] if header.get("baseline") else []
        got.tasks += header.get("tasks") or []
        listed = header.get("arms")
        for arm in listed if isinstance(listed, dict) else {}:  # a sweep's results header
            got.named.setdefault(str(arm), f"an arm of {ident}")


def _runs_of(c: Any, uri: str, ident: str) -> tuple[Run | None, list[Run]]:
    """A sweep id's or parent run id's parent and child runs, or a lone run id's run."""
    ref = store.find_sweep(c, ident)
    parent = ref.parent if ref else None
    if parent is None:
        from mlflow.exceptions import MlflowException

        try:
            run = c.get_run(ident)
        except MlflowException:
            raise SweepError(
                f"No sweep or run {ident!r} in the MLflow store {uri}.",
                "List sweeps and runs with `gemctl runs`; pass a sweep id (e.g. "
                "attention-20260101-120000) or run ids.") from None
        if run.data.tags.get(store.TAG_ROLE) != store.ROLE_PARENT:
            return None, [run]
        parent = run
    runs = store.children(c, parent)
    if not runs:
        raise SweepError(f"Sweep {ident!r} has no child runs yet.",
                         "Run (or resume) it with `gemctl sweep SPEC`.")
    return parent, runs


def _arm_recipes(parent: Run) -> tuple[dict[str, str], dict[str, tuple[str | None, str]]]:
    """What each arm name means in a sweep, from its parent run's params: the arms' recipe
    fingerprints (``sweep.recipe.<arm>``, as results files hold them), and for a parent
    recorded before those, the base recipe's name with the arm's overrides
    (``sweep.arm.<arm>``)."""
    params = parent.data.params
    fingerprints = {k.removeprefix(store.PARAM_ARM_RECIPE): v for k, v in params.items()
                    if k.startswith(store.PARAM_ARM_RECIPE)}
    if fingerprints:
        return fingerprints, {}
    recipe = parent.data.tags.get(store.TAG_RECIPE)
    return {}, {k.removeprefix(store.PARAM_ARM): (recipe, v) for k, v in params.items()
                if k.startswith(store.PARAM_ARM)}


def _collect_tracked(uri: str, ids: list[str], trials: dict[str, TrialRun],
                     got: Collected) -> None:
    """The finished child runs of tracked sweeps (and lone runs); unfinished ones are left out
    and their arms named."""
    c = store.client(uri)
    parents: dict[str, Run] = {}
    named_only: dict[str, tuple[Any, str]] = {}  # parents without fingerprints, among them
    for ident in ids:
        parent, runs = _runs_of(c, uri, ident)
        if parent is not None:
            parents[parent.info.run_id] = parent
            fingerprints, names = _arm_recipes(parent)
            source = parent.data.tags.get(store.TAG_SWEEP) or ident
            _check_same_recipes(got.recipes, fingerprints, source)
            _check_same_recipes(named_only, names, source)
        for run in runs:
            if run.info.status != "FINISHED":
                got.skipped.append(run.info.run_id)
                arm = run.data.tags.get(store.TAG_ARM)
                if arm:
                    got.named.setdefault(arm, f"its runs {run.info.status.lower()}")
                continue
            sweep = parent.data.tags.get(store.TAG_SWEEP) if parent else None
            trials[run.info.run_id] = _as_trial(run, sweep, parent.info.run_id if parent
                                                else None)
    tracked = [b for p in parents.values() if (b := p.data.tags.get(store.TAG_BASELINE))]
    got.baselines = tracked + got.baselines  # a sweep's own baseline before a file's


def collect(uri: str, ids: list[str]) -> Collected:
    """Resolve sweep ids, parent run ids, run ids and results files (``*.json``, written by
    an in-process sweep) into finished trial runs; sources that mean two recipes by one arm
    name are refused."""
    got, trials = Collected(), {}
    _collect_files([i for i in ids if is_results_file(i)], trials, got)
    tracked = [i for i in ids if not is_results_file(i)]
    if tracked:
        _collect_tracked(uri, tracked, trials, got)
    got.trials = list(trials.values())
    return got


# Metrics whose name ends in a task that a run evaluated: its NE, or its sample count, which
# an evaluation records even where the NE can't be computed (a split without positives).
TASK_MARKERS = ("eval/ne_", "eval/count_")


def _tasks(trials: list[TrialRun], declared: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The tasks any run evaluated, or a saved comparison declares, whether or not any NE of
    them is finite: a task whose NE no run could compute keeps its row and its gate."""
    found = {k.removeprefix(m) for t in trials for k in t.metrics for m in TASK_MARKERS
             if k.startswith(m)} | set(declared)
    order = ["ctr", "cvr"]
    return [t for t in order if t in found] + sorted(found - set(order))


def _context_names(tasks: list[str]) -> list[str]:
    """Facts of each run that the gates and notes read but no arm is compared on: how many
    trials shared its machine, how long it took, how many epochs it trained, and its dataset's
    ceiling without the world's own term."""
    return [CONCURRENT_TRIALS, TRIAL_WALL_S, TRAINED_EPOCHS] + [
        BLIND_AUC_METRIC.format(task=t) for t in tasks]


def _metric_names(tasks: list[str]) -> list[str]:
    return [f"eval/{q}_{t}" for t in tasks for q in QUALITY] + list(EFFICIENCY) + \
        _context_names(tasks)


def _relative_metric(name: str) -> bool:
    return name.startswith("eval/ne_") or name == "perf/qps"


def _by_seed(runs: list[TrialRun], name: str) -> dict[str, float] | None:
    """The metric per seed, or None when a seed appears twice (then runs can't be paired)."""
    pairs = [(r.seed, r.metrics[name]) for r in runs if name in r.metrics]
    by_seed = dict(pairs)
    return by_seed if len(by_seed) == len(pairs) else None


def delta_to_baseline(runs: list[TrialRun], base_runs: list[TrialRun], name: str,
                      percent: bool = False, apart: Collection[str] = ()) -> Delta:
    """Paired over the seeds both arms ran (at least two, each once) on one device, else
    Welch over the two sets of runs; with ``percent``, in percent of the baseline's mean over
    the same runs. Pairing on the common seeds matters when one arm ran fewer: a cut-short
    sweep, or arms from two sweeps. Seed-to-seed spread is often larger than the effect, so a
    difference of means over different seeds measures mostly which seeds each arm got. The
    seeds ``apart`` (the two arms ran them on different devices: ``cross_device_seeds``) are
    left out of the pairs."""
    arm, base = _by_seed(runs, name), _by_seed(base_runs, name)
    seeds = sorted((arm.keys() & base.keys()) - set(apart)) if arm and base else []
    if len(seeds) >= 2:
        d = paired_delta([arm[s] for s in seeds], [base[s] for s in seeds])
        base_values = [base[s] for s in seeds]
    else:
        base_values = [r.metrics[name] for r in base_runs if name in r.metrics]
        d = welch_delta([r.metrics[name] for r in runs if name in r.metrics], base_values)
    return relative(d, summarize(base_values).mean) if percent else d


def _seed_order(seed: str) -> tuple[bool, int, str]:
    """Numeric seeds first in numeric order (any length), then the others as text."""
    numeric = seed.isascii() and seed.isdigit()
    return (not numeric, len(seed.lstrip("0")) if numeric else 0, seed)


def compare_trials(trials: list[TrialRun], baseline: str | None = None,
                   tasks: list[str] | tuple[str, ...] = ()) -> Comparison:
    """The arms of ``trials`` against ``baseline`` (default the first arm), over the tasks the
    runs evaluated and ``tasks``."""
    if not trials:
        raise SweepError("No finished runs to compare.",
                         "Wait for the sweep to finish, or resume it with `gemctl sweep SPEC`.")
    arms: dict[str, list[TrialRun]] = {}
    for t in trials:
        arms.setdefault(t.arm, []).append(t)
    base = baseline or next(iter(arms))
    if base not in arms:
        raise SweepError(f"Baseline arm {base!r} is not among the compared arms "
                         f"({', '.join(arms)}).", "Pass --baseline with one of them.")
    tasks = _tasks(trials, tasks)
    names, context = _metric_names(tasks), set(_context_names(tasks))

    def values(runs: list[TrialRun], name: str) -> list[float]:
        return [r.metrics[name] for r in runs if name in r.metrics]

    results, base_devices = [], seed_devices(arms[base])
    for arm, runs in arms.items():
        runs = sorted(runs, key=lambda r: _seed_order(r.seed))
        res = ArmResult(arm, [r.run_id for r in runs], [r.seed for r in runs],
                        commits={r.seed: r.commit for r in runs if r.commit},
                        devices=seed_devices(runs))
        apart = cross_device_seeds(res.devices, base_devices)
        for name in names:
            res.metrics[name] = summarize(values(runs, name))
            res.per_seed[name] = [r.metrics.get(name) for r in runs]
            if arm != base and name not in context:
                res.deltas[name] = delta_to_baseline(runs, arms[base], name,
                                                     percent=_relative_metric(name), apart=apart)
        results.append(res)
    results.sort(key=lambda r: r.arm != base)
    sweeps = sorted({t.sweep_id for t in trials if t.sweep_id})
    parents = sorted({t.parent_run_id for t in trials if t.parent_run_id})
    return Comparison(base, tasks, results, sweeps, parents)


def only_arms(trials: list[TrialRun], arms: list[str], baseline: str) -> list[TrialRun]:
    """The trials of ``arms`` and of ``baseline``, so the table and the gates answer those
    arms alone; a name the trials don't hold is an error."""
    present = {t.arm for t in trials}
    missing = [a for a in arms if a not in present]
    if missing:
        raise SweepError(f"--arms {', '.join(missing)}: not among the compared runs' arms "
                         f"({', '.join(sorted(present))}).",
                         "Name arms the runs hold, or leave --arms out to compare them all.")
    return [t for t in trials if t.arm in {*arms, baseline}]


def compare(uri: str, ids: list[str], baseline: str | None = None,
            gates: Gates | None = None, arms: list[str] | None = None) -> Comparison:
    """Collect, compare and gate. The baseline defaults to the sweep's own; ``arms`` narrows
    the comparison to those arms against it."""
    got = collect(uri, ids)
    trials = got.trials
    finished = {t.arm for t in trials}
    if baseline is None and got.baselines and got.baselines[0] in finished:
        baseline = got.baselines[0]
    if arms:
        baseline = baseline or arms[0]
        trials = only_arms(trials, arms, baseline)
    cmp = compare_trials(trials, baseline, got.tasks)
    cmp.skipped = got.skipped
    cmp.unfinished = {arm: why for arm, why in got.named.items()
                      if arm not in finished and (not arms or arm in arms)}
    if gates is not None:
        # a control's expectations speak of the arms compared: a sweep run on some of its arms
        # leaves the others' unjudged (an unfinished arm has its own inconclusive verdict)
        judged = {res.arm for res in cmp.arms}
        cmp.verdicts = expect_verdicts(check_gates(cmp, gates),
                                       [e for e in gates.expect if e.arm in judged])
    return cmp
