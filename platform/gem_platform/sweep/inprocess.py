"""Run a sweep's trials on this machine, one after another or a few at once: no Ray, no MLflow.

For a machine that has the GPU but not the cluster services (a lone H200 box, a notebook):
each (arm, seed) trains through the same ``train`` function a Ray trial runs, and the
results go to a JSON file, rewritten after every trial so an interrupted sweep keeps what it
finished. Each trial trains in a fresh process (spawned), so a trial's metrics and speed do
not depend on the trials before it: compiled graphs and Dynamo's caches, the allocator's
pools, cuBLAS's workspace setting (read once per process) all start clean, as for a rerun of
that trial alone. ``--same-process`` trains them all in this one (quicker to start on CPU).
``gemctl compare FILE.json`` gives the same table, intervals and gates as for a
tracked sweep.

The file records where each result came from: the header's ``provenance`` (the sweep's
fingerprint, code version, datasets' fingerprints, device and library versions, every arm's
resolved recipe and whether it trained deterministically), and per trial its commit, its
``train/deterministic`` flag and its step history (the NE-vs-step chart of ``gemctl compare
--plot``), and its ``rounds``: the trials each call added, the points at which its gates could
have been read (``gemctl bench looks`` reads a gate at the level for all of them). A file
whose trials came from another commit is resumed only with ``--allow-code-change``, one whose
trials trained on another device (each records its own) only with ``--allow-device-change``.
Nothing here imports Ray or MLflow.

    python -m gem_platform.sweep.inprocess recipes/ablations/precision_h200.yaml \\
        --out gem_runs/precision_h200.json

``--parallel N`` trains N trials at once, each in its own fresh process, sharing the machine's
GPU; a trial that runs out of memory beside others trains again with one fewer at a time. A
deterministic trial is meant to give the same NE bit for bit whatever company it keeps; the
committed H200 ablations show it for most trials, with one exception (docs/quality/README.md):
a compile cache shared with another recipe's trials is the mechanism found since, so a
deterministic run now compiles into its recipe's own (gem_platform.train.compile_cache). A
small model leaves most of an H200 idle between its kernels (start-up, compilation,
evaluation), so N trials finish sooner than one after another; N is bounded by the device's
memory. Their QPS and MFU are shares of the device, not speed figures: each trial records
``trial/concurrent_trials`` (the trials at a time when it started), and ``gemctl compare``
says so and holds a QPS gate inconclusive for them.

Results files of separate runs (other machines, or ``--arms A --seeds S --out part.json``
each) become one file with ``python -m gem_platform.sweep.inprocess --merge part*.json --out
all.json`` (gem_platform.sweep.merge).
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gem_platform.errors import GemError
from gem_platform.fresh_process import call_in_fresh_process
from gem_platform.progress import Echo, TrialDone, in_trial
from gem_platform.provenance import environment
from gem_platform.recipe import Recipe
from gem_platform.sweep.config import SweepPlan, load_sweep
from gem_platform.sweep.results import (
    CONCURRENT_TRIALS,
    TRIAL_WALL_S,
    TrialRun,
    cross_device_seeds,
    finite_metrics,
    load_results,
    rounds_of,
    seed_devices,
    trial_key,
    write_results,
)

HISTORY = ("train/loss", "train/ne_ctr", "eval/ne_ctr", "eval/ne_cvr", "eval/auc_ctr",
           "eval/auc_cvr")


class _History:
    """A ``train`` sink keeping the step series of HISTORY's metrics."""

    def __init__(self) -> None:
        self.points: dict[str, list[tuple[int, float]]] = {}

    def __call__(self, metrics: dict[str, Any], step: int) -> None:
        for key in HISTORY:
            value = metrics.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                self.points.setdefault(key, []).append((int(step), float(value)))


@dataclass(frozen=True)
class _Origin:
    """Where a trial came from that a resumed file's trials must share: the same seed of other
    code or on another card can train to other bits (docs/quality), so mixing them is
    explicit."""

    attr: str  # the TrialRun field
    differs: str  # "trials {differs} ({this run's value})"
    change: str  # "resuming ... with a {change}"
    flag: str  # the option that allows the mix
    shown: int  # characters of a value shown


_CODE = _Origin("commit", "of other code than this commit", "code change",
                "--allow-code-change", 12)
_DEVICE = _Origin("device", "trained on another device than this one", "device change",
                  "--allow-device-change", 40)


def _check_origin(done: list[TrialRun], origin: _Origin, now: str | None, out: Path,
                  allowed: bool, echo: Echo) -> None:
    """Refuse to add trials of ``now`` (this commit, this device) to a file whose trials came
    from another, unless ``allowed``; either way say which trials came from where."""
    here = now or "unknown"
    by_origin: dict[str, list[str]] = {}
    for t in done:
        by_origin.setdefault(getattr(t, origin.attr) or "unknown", []).append(
            f"{t.arm} seed {t.seed}")
    if not {v for v in by_origin if v != here}:
        return
    listing = "; ".join(f"{origin.attr} {v[:origin.shown]}: {', '.join(runs)}"
                        for v, runs in by_origin.items())
    if not allowed:
        raise GemError(f"{out} holds trials {origin.differs} ({here[:origin.shown]}): "
                       f"{listing}.",
                       f"Resume it with the {origin.attr} they trained with, pass "
                       f"{origin.flag} to add trials of this one (each trial records its "
                       f"{origin.attr}), or --new.")
    echo(f"resuming {out} with a {origin.change} ({origin.flag}): {listing}; new trials "
         f"train with {origin.attr} {here[:origin.shown]}")


def train_trial(recipe: Recipe, label: str, echo: Echo = print
                ) -> tuple[dict[str, Any], dict[str, list[tuple[int, float]]]]:
    """Train one trial in this process: its summary and its HISTORY step series; its progress
    events go to ``echo`` as the TrialProgress of ``label``."""
    from gem_platform.train.loop import train

    history = _History()
    summary = train(recipe, sink=history, echo=in_trial(label, echo))
    return summary, history.points


def run_in_process(plan: SweepPlan, out: str | Path, echo: Echo = print,
                   resume: bool = True, allow_code_change: bool = False,
                   isolate: bool = True, parallel: int = 1,
                   allow_device_change: bool = False) -> list[TrialRun]:
    """Train every (arm, seed) of ``plan``, in the plan's order (all arms of a seed before
    the next seed, so a cut-short sweep still pairs), each in a fresh process unless
    ``isolate`` is off; ``parallel`` > 1 trains that many at once (each in a fresh process)
    and records it per trial as ``trial/concurrent_trials``. With ``resume``, trials already
    in ``out`` (same sweep name, same recipes) are kept, not retrained; trials of another
    commit only with ``allow_code_change``, of another device only with
    ``allow_device_change``."""
    if parallel < 1 or (parallel > 1 and not isolate):
        raise GemError(f"parallel={parallel} with isolate={isolate}: trials run side by side "
                       "only each in its own process.",
                       "Pass --parallel N (N >= 1) without --same-process.")
    from gem_platform.data.prepare import prepare_dataset
    from gem_platform.provenance import code_version

    out = Path(out)
    code, env = code_version(), environment()
    commit, device = code["commit"], env["device"]
    recipes = plan.arm_fingerprints()
    arms: dict[str, Any] = {a.name: a.overrides for a in plan.arms}
    done: list[TrialRun] = []
    rounds: list[list[str]] = []  # this call's trials join them as one more round
    if resume and out.exists():
        done, before = _resumable(plan, out, recipes)
        rounds = rounds_of(before, done)
        _check_origin(done, _CODE, commit, out, allow_code_change, echo)
        _check_origin(done, _DEVICE, device, out, allow_device_change, echo)
        recipes = {**before.get("recipes", {}), **recipes}
        arms = {**(before.get("arms") or {}), **arms}
    for arm in {a.recipe.data.path: a for a in plan.arms}.values():
        prepare_dataset(arm.recipe.data)  # before the fingerprint record reads the shards
    record = {**plan.fingerprint_record(), "code": code}
    have = {(t.arm, t.seed) for t in done}
    header = {"sweep": plan.name, "spec": plan.spec_path, "base": plan.base_path,
              "baseline": plan.baseline, "seeds": plan.seeds,
              "arms": arms, "device": env,
              "recipes": recipes, "provenance": record, "rounds": rounds}
    this_round: list[str] = []
    todo = []
    for arm, seed in plan.trials():
        if (arm, str(seed)) in have:
            echo(TrialDone(f"{arm} seed {seed}", "kept", where=str(out)))
        else:
            todo.append((arm, seed))
    _warn_unpairable(todo, done, plan.baseline, device, echo)
    for arm, seed, (summary, points, wall_s), company in _trained(plan, todo, isolate, parallel,
                                                                   echo):
        metrics = finite_metrics(summary)
        metrics[TRIAL_WALL_S] = wall_s
        metrics[CONCURRENT_TRIALS] = float(min(company, len(todo)))
        metrics["train/deterministic"] = float(record["deterministic"][arm])
        done.append(TrialRun(run_id=f"{plan.name}/{arm}/seed{seed}", arm=arm, seed=str(seed),
                             metrics=metrics, sweep_id=plan.name, commit=commit,
                             device=device, history=points))
        if not this_round:
            rounds.append(this_round)
        this_round.append(trial_key(arm, seed))
        write_results(out, header, done)
        echo(TrialDone(f"{arm} seed {seed}", "finished", metrics.get("eval/ne_ctr", math.nan),
                       metrics.get("eval/auc_ctr", math.nan), f"in {out}"))
    return done


def _warn_unpairable(todo: list[tuple[str, int]], done: list[TrialRun], baseline: str,
                     device: str, echo: Echo) -> None:
    """Say before training which new trials ``gemctl compare`` will not pair with their seed's
    partner (the baseline's run, or for a baseline trial the other arms' runs), because that
    run trained on another device than this one (``results.cross_device_seeds``)."""
    ran_on = {arm: seed_devices(t for t in done if t.arm == arm) for arm in {t.arm for t in done}}

    def partners(arm: str) -> list[dict[str, str]]:
        return ([ran_on.get(baseline, {})] if arm != baseline else
                [seeds for other, seeds in ran_on.items() if other != baseline])

    apart = [f"{arm} seed {seed}" for arm, seed in todo
             if any(cross_device_seeds({str(seed): device}, p) for p in partners(arm))]
    if apart:
        echo(f"warning: {', '.join(apart)} will train on {device}, but the run it is compared "
             "with (the same seed of the baseline or of the other arms) trained on another "
             "device, so gemctl compare will not pair them; to pair them, train both arms of "
             "those seeds on one device (another --out)")


def _resumable(plan: SweepPlan, out: Path, recipes: dict[str, str]
               ) -> tuple[list[TrialRun], dict[str, Any]]:
    """The trials already in ``out`` and its header (its ``recipes`` a mapping), once checked
    to be this sweep's: same name, the same recipe for every arm both hold."""
    earlier, header = load_results(out)
    before = header.get("recipes")
    header = {**header, "recipes": before if isinstance(before, dict) else {}}
    changed = sorted(a for a in recipes
                     if a in header["recipes"] and header["recipes"][a] != recipes[a])
    if header.get("sweep") != plan.name or changed:
        raise GemError(f"{out} holds results of other recipes (sweep "
                       f"{header.get('sweep')!r}, arms {changed or 'all'}) than this run of "
                       f"{plan.name!r}.", "Pass another --out, or --new to overwrite it.")
    return earlier, header


def _train(plan: SweepPlan, arm: str, seed: int, isolate: bool, echo: Echo
           ) -> tuple[dict[str, Any], dict[str, list[tuple[int, float]]], float]:
    """One trial: its summary, its HISTORY step series and its wall seconds."""
    recipe, label = plan.trial_recipe(arm, seed), f"{arm} seed {seed}"
    t0 = time.perf_counter()
    summary, points = (call_in_fresh_process(train_trial, recipe, label, echo=echo)
                       if isolate else train_trial(recipe, label, echo))
    return summary, points, time.perf_counter() - t0


def _trained(plan: SweepPlan, todo: list[tuple[str, int]], isolate: bool, parallel: int,
             echo: Echo) -> Iterator[tuple[str, int, Any, int]]:
    """(arm, seed, _train's result, trials at a time when it started) for each trial of
    ``todo`` as it finishes: one after another, or up to ``parallel`` at a time
    (``_side_by_side``)."""
    if parallel <= 1:
        for arm, seed in todo:
            yield arm, seed, _train(plan, arm, seed, isolate, echo), 1
        return
    yield from _side_by_side(plan, todo, parallel, echo)


def _side_by_side(plan: SweepPlan, todo: list[tuple[str, int]], parallel: int, echo: Echo
                  ) -> Iterator[tuple[str, int, Any, int]]:
    """``_trained`` with up to ``parallel`` trials at a time: threads, each waiting on the
    trial's own process; their progress events reach ``echo`` one at a time; the next trial
    starts as one ends. A trial that runs out of memory beside others trains again later, and
    from then on one trial fewer runs at a time (at one at a time, its failure stands). Once
    a trial fails no other starts; those running finish and are yielded, then the failure is
    raised as a GemError."""
    lock = threading.Lock()

    def one_at_a_time(event: Any) -> None:
        with lock:
            echo(event)

    failed: tuple[str, int, BaseException] | None = None
    queued, limit = deque(todo), parallel
    running: dict[Future, tuple[str, int, int]] = {}
    with ThreadPoolExecutor(parallel, thread_name_prefix="trial") as pool:

        def fill() -> None:
            while failed is None and queued and len(running) < limit:
                arm, seed = queued.popleft()
                future = pool.submit(_train, plan, arm, seed, True, one_at_a_time)
                running[future] = (arm, seed, limit)

        fill()
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            done = []
            for future in finished:
                arm, seed, company = running.pop(future)
                err = future.exception()
                if err is None:
                    done.append((arm, seed, future.result(), company))
                elif isinstance(err, MemoryError) and limit > 1 and failed is None:
                    limit -= 1
                    queued.appendleft((arm, seed))
                    one_at_a_time(f"trial {arm} seed {seed} ran out of memory beside other "
                                  f"trials: it trains again, {limit} trial(s) at a time from "
                                  "now on")
                elif failed is None:
                    failed = (arm, seed, err)
            fill()
            yield from done
    if failed is not None:
        arm, seed, err = failed
        raise GemError(f"Trial {arm} seed {seed} failed: {type(err).__name__}: {err}",
                       "The trials that finished are in the results file; the same command "
                       "trains only the missing ones. Out of GPU memory with --parallel N: "
                       "lower N (each trial holds its own model, batches and compiled "
                       "graphs on the one device; a trial out of memory beside others is "
                       "tried again with fewer at a time, one out of memory alone needs the "
                       "recipe's fixes).") from err


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", nargs="?",
                   help="sweep spec YAML, e.g. recipes/ablations/precision_h200.yaml")
    p.add_argument("--out", required=True, help="results JSON (rewritten after each trial)")
    p.add_argument("--merge", nargs="+", metavar="FILE",
                   help="instead of training: merge these results files of one sweep (e.g. one "
                        "process per arm and seed) into --out")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[],
                   help="override a field of the base recipe for every arm (repeatable)")
    p.add_argument("--seeds", type=int, nargs="+", help="run these seeds instead of the spec's")
    p.add_argument("--arms", nargs="+", help="run only these arms")
    p.add_argument("--new", action="store_true", help="overwrite --out instead of resuming it")
    p.add_argument("--allow-code-change", action="store_true",
                   help="resume --out although its trials came from another git commit")
    p.add_argument("--allow-device-change", action="store_true",
                   help="resume --out although its trials trained on another device")
    p.add_argument("--same-process", action="store_true",
                   help="train every trial in this process (default: each in a fresh one)")
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="train N trials at once, each in its own process (they share this "
                        "machine's GPU; QPS a share of it)")
    args = p.parse_args(argv)
    if args.merge:
        return _merge(args.merge, args.out)
    if not args.spec:
        p.error("a sweep spec is needed to train (or pass --merge FILE...)")
    try:
        plan = load_sweep(args.spec, args.overrides)
        plan = narrowed(plan, args.seeds, args.arms)
        run_in_process(plan, args.out, resume=not args.new,
                       allow_code_change=args.allow_code_change,
                       allow_device_change=args.allow_device_change,
                       isolate=not args.same_process, parallel=args.parallel)
    except GemError as err:
        print(err.as_text(), file=sys.stderr)
        return 2
    print(f"results: {args.out}  (compare: gemctl compare {args.out})")
    return 0


def _merge(paths: list[str], out: str) -> int:
    from gem_platform.sweep.merge import merge_results

    try:
        trials = merge_results(paths, out)
    except GemError as err:
        print(err.as_text(), file=sys.stderr)
        return 2
    print(f"results: {out}  ({len(trials)} trials from {len(paths)} files; compare: "
          f"gemctl compare {out})")
    return 0


def narrowed(plan: SweepPlan, seeds: list[int] | None, arms: list[str] | None) -> SweepPlan:
    """``plan`` with only ``arms`` (GemError naming unknown ones) and ``seeds`` instead of the
    spec's; None keeps the spec's."""
    if arms:
        unknown = sorted(set(arms) - {a.name for a in plan.arms})
        if unknown:
            raise GemError(f"No arm {', '.join(unknown)} in sweep {plan.name!r}.",
                           f"Arms: {', '.join(a.name for a in plan.arms)}.")
        plan = replace(plan, arms=[a for a in plan.arms if a.name in arms])
    if seeds:
        plan = replace(plan, seeds=list(seeds))
    return plan


if __name__ == "__main__":
    sys.exit(main())
