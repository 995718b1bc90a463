"""Gates judged on the interval, through the real `gemctl compare` on synthetic results files:
pass (exit 0), fail (exit 1) and inconclusive (exit 3, with the seeds that would settle it);
one seed is always inconclusive. Then compare reads its own --json back, reads every results
file under docs/bench/, and --plot writes both charts for a results file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gem_platform.sweep.compare import compare
from gem_platform.sweep.gates import LOOKS_ADVICE, Gates
from gem_platform.sweep.results import TrialRun, load_results, write_results
from gem_platform.sweep.stats import seeds_to_settle, seeds_to_settle_closer
from tests.conftest import REPO, gemctl_in_process

BASE_NE = [0.900, 0.910, 0.920, 0.930]


def results_file(path: Path, rel_diffs_pct: list[float]) -> Path:
    """A baseline and one arm whose NE differs from the baseline's by these percents, seed by
    seed (the seed moves NE by ~1%, far more than the arm: only pairing sees the arm)."""
    trials = []
    for seed, (base, diff) in enumerate(zip(BASE_NE, rel_diffs_pct, strict=False)):
        for arm, ne in (("base", base), ("arm", base * (1 + diff / 100))):
            trials.append(TrialRun(f"{arm}{seed}", arm, str(seed),
                                   {"eval/ne_ctr": ne, "eval/auc_ctr": 0.7, "perf/qps": 1000.0},
                                   commit="c0ffee"))
    header = {"sweep": path.stem, "baseline": "base", "seeds": list(range(len(rel_diffs_pct)))}
    return write_results(path, header, trials)


CASES = {  # name: (per-seed NE difference in %, verdict, exit code)
    "within": ([-0.02, 0.01, 0.0, -0.01], "pass", 0),
    "beyond": ([0.50, 0.52, 0.48, 0.51], "fail", 1),
    "straddles": ([0.30, -0.20, 0.25, -0.15], "inconclusive", 3),
    "one_seed": ([0.01], "inconclusive", 3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_verdict_and_exit_code(tmp_path: Path, name: str):
    diffs, verdict, code = CASES[name]
    results_file(tmp_path / f"{name}.json", diffs)
    proc = gemctl_in_process("compare", f"{name}.json", "--max-ne-regression", "0.1%", "--no-plot",
                      cwd=tmp_path)
    assert proc.returncode == code, proc.stdout + proc.stderr
    out = " ".join((proc.stdout + proc.stderr).split())
    assert verdict.upper() in out  # the verdict in words, not only in colour
    assert f"0:{BASE_NE[0]:.4f}" in out  # each seed's value beside the mean
    if name == "straddles":
        assert "seeds per arm would settle it" in out
    if name == "one_seed":
        assert "no interval from 1 seed(s) of this arm" in out and "needs 2+ seeds" in out
    body = json.loads(gemctl_in_process("compare", f"{name}.json", "--max-ne-regression", "0.1%",
                                 "--no-plot", "--json", cwd=tmp_path).stdout)
    (v,) = body["verdicts"]
    assert (v["verdict"], body["exit_code"]) == (verdict, code)


def test_seeds_to_settle_from_the_observed_spread(tmp_path: Path):
    diffs = CASES["straddles"][0]
    cmp = compare("", [str(results_file(tmp_path / "s.json", diffs))],
                  gates=Gates(max_ne_regression_pct=0.1))
    (v,) = cmp.verdicts
    # the mean +0.05% sits 0.05 below the limit; the spread of the per-seed differences
    # (sd ~0.27%) needs a half width under 0.05: t * 0.27 / sqrt(n) < 0.05 -> n ~ 115
    assert v.verdict == "inconclusive" and 100 < v.seeds_needed < 140
    assert v.seeds_needed == seeds_to_settle(v.regression, cmp.arms[1].deltas["eval/ne_ctr"].sd,
                                             0.1)
    assert seeds_to_settle(0.5, float("nan"), 0.1) is None  # one seed: no spread to go on
    assert v.settle_cost is None  # no run recorded its wall time: no cost to state
    # one standard error (0.27 / 2) up puts the mean past the limit: no count is sure
    assert v.seeds_needed_closer is None and "no count of seeds is sure" in v.message


def test_the_ask_says_how_far_it_grows_as_the_mean_moves():
    """More seeds move the mean by about a standard error; near the limit that changes the ask
    several-fold, so the verdict gives the ask of a mean one standard error closer too."""
    # 100 seeds at sd 0.27: a standard error of 0.027, toward the limit from either side
    assert seeds_to_settle_closer(0.0, 0.27, 100, 0.1) == seeds_to_settle(0.027, 0.27, 0.1)
    assert seeds_to_settle_closer(0.3, 0.27, 100, 0.1) == seeds_to_settle(0.273, 0.27, 0.1)
    assert seeds_to_settle(0.0, 0.27, 0.1) < seeds_to_settle_closer(0.0, 0.27, 100, 0.1)
    assert seeds_to_settle_closer(0.09, 0.27, 100, 0.1) is None  # the step crosses the limit
    assert seeds_to_settle_closer(0.0, 0.27, 1, 0.1) is None  # no spread from one seed
    assert seeds_to_settle_closer(0.0, float("nan"), 5, 0.1) is None


def test_the_seeds_to_settle_come_with_their_cost(tmp_path: Path):
    """Where the runs recorded their wall time (in-process sweeps), an inconclusive verdict
    says what its missing trials would take: both arms' trials beyond those run, each arm's at
    the median pace of its trials (a trial's wall time over the trials sharing its machine)."""
    path = results_file(tmp_path / "s.json", CASES["straddles"][0])
    trials, header = load_results(path)
    for t in trials:  # the arm's trials 60 s two at a time, the baseline's 20 s alone
        t.metrics.update({"trial/wall_s": 60.0 if t.arm == "arm" else 20.0,
                          "trial/concurrent_trials": 2.0 if t.arm == "arm" else 1.0})
    trials[0].metrics["trial/wall_s"] = 900.0  # one slow start: not the median
    write_results(path, header, trials)
    cmp = compare("", [str(path)], gates=Gates(max_ne_regression_pct=0.1))
    (v,) = cmp.verdicts
    more, hours = 2 * (v.seeds_needed - 4), (v.seeds_needed - 4) * (30 + 20) / 3600
    assert v.settle_cost == (more, pytest.approx(hours))
    assert f"; {v.seeds_needed} seeds: {more} more trials, ~{hours:.1f} h of machine time" \
        in v.message
    # and, after its price, why to fix that count before running it
    assert v.message.endswith(LOOKS_ADVICE) and "`gemctl bench looks`" in LOOKS_ADVICE
    proc = gemctl_in_process("compare", "s.json", "--max-ne-regression", "0.1%", "--no-plot",
                             cwd=tmp_path)
    assert f"~{v.seeds_needed} seeds" in proc.stdout
    assert f"{more} more trials" in " ".join(proc.stdout.split())
    body = json.loads(gemctl_in_process("compare", "s.json", "--max-ne-regression", "0.1%",
                                        "--no-plot", "--json", cwd=tmp_path).stdout)
    assert body["verdicts"][0]["settle_cost"][0] == more
    # the markdown table's cell too; under an hour in minutes
    from gem_platform.sweep.gates import cost_words
    from gem_platform.sweep.report import quality_markdown

    assert (f"~{v.seeds_needed} seeds (no sure count if the mean moves 1 SE closer): "
            f"{more} more trials, ~{hours:.1f} h |") in quality_markdown(cmp)
    assert cost_words((10, 0.1)) == "10 more trials, ~6 min"
    assert cost_words((912, 10.0)) == "912 more trials, ~10.0 h"


def test_only_an_ask_for_seeds_advises_fixing_their_count(tmp_path: Path):
    """A settled verdict, or one with no spread to size an ask from, carries no advice about
    how to add seeds."""
    for name in ("within", "beyond", "one_seed"):
        path = results_file(tmp_path / f"{name}.json", CASES[name][0])
        (v,) = compare("", [str(path)], gates=Gates(max_ne_regression_pct=0.1)).verdicts
        assert v.seeds_needed is None and LOOKS_ADVICE not in v.message


def test_compare_reads_its_own_json_back(tmp_path: Path):
    results_file(tmp_path / "r.json", CASES["straddles"][0])
    first = gemctl_in_process("compare", "r.json", "--json", "--no-plot", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (tmp_path / "cmp.json").write_text(first.stdout)
    again = gemctl_in_process("compare", "cmp.json", "--json", "--no-plot", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    # `gemctl sweep --json` wraps the same comparison in the sweep's outcome
    outcome = {"sweep_id": "r", "status": "FINISHED", "comparison": json.loads(first.stdout)}
    (tmp_path / "sweep.json").write_text(json.dumps(outcome))
    wrapped = gemctl_in_process("compare", "sweep.json", "--json", "--no-plot", cwd=tmp_path)
    assert wrapped.returncode == 0, wrapped.stderr
    assert json.loads(wrapped.stdout)["arms"] == json.loads(again.stdout)["arms"]
    a, b = json.loads(first.stdout), json.loads(again.stdout)
    assert a["format"] == b["format"] == "gem-comparison/1"
    for x, y in zip(a["arms"], b["arms"], strict=True):
        assert x["per_seed"] == y["per_seed"] and x["commits"] == y["commits"] == \
            dict.fromkeys(x["seeds"], "c0ffee")
        assert x["deltas"] == y["deltas"]


BENCH = sorted((REPO / "docs/bench").glob("precision_*.json")) + \
    sorted((REPO / "docs/quality").glob("ablation_*.json"))
SHARED = sorted((REPO / "docs/quality").glob("ablation_*_h200.json"))


@pytest.mark.parametrize("path", BENCH, ids=[p.name for p in BENCH])
def test_every_results_file_under_docs_bench_compares(path: Path, tmp_path: Path):
    proc = gemctl_in_process("compare", str(path), "--json", "--no-plot", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    trials, header = load_results(path)
    assert body["baseline"] == header["baseline"]
    assert {a["arm"] for a in body["arms"]} == {t.arm for t in trials}
    assert all(a["deltas"]["eval/ne_ctr"]["value"] is not None for a in body["arms"]
               if a["arm"] != body["baseline"])


@pytest.mark.parametrize("path", SHARED, ids=[p.name for p in SHARED])
def test_committed_trials_that_shared_the_gpu_hold_their_qps_gate_inconclusive(path: Path,
                                                                              tmp_path: Path):
    trials, _ = load_results(path)
    assert all(t.metrics["trial/concurrent_trials"] > 1 for t in trials)
    proc = gemctl_in_process("compare", str(path), "--json", "--no-plot", "--max-qps-drop",
                             "99%", cwd=tmp_path)
    qps = [v for v in json.loads(proc.stdout)["verdicts"] if v["metric"] == "perf/qps"]
    assert qps and all(v["verdict"] == "inconclusive" and v["shared"] for v in qps)


def test_plot_for_a_results_file_writes_both_charts(tmp_path: Path):
    path = results_file(tmp_path / "r.json", CASES["within"][0])
    body = json.loads(path.read_text())
    for t in body["trials"]:  # step histories, as an in-process sweep records them
        end = t["metrics"]["eval/ne_ctr"]
        t["history"] = {"train/ne_ctr": [[s, end + 0.1 / s] for s in (1, 2, 3)]}
    path.write_text(json.dumps(body))
    proc = gemctl_in_process("compare", "r.json", "--plot", "out/r.png", "--max-ne-regression",
                      "0.1%", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("r.png", "r-deltas.png"):
        png = tmp_path / "out" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_gates_with_nothing_but_the_baseline_to_judge_never_pass(tmp_path: Path):
    """A results file whose other arm has no finished run (here a committed one-arm file), or a
    comparison narrowed to the baseline: gates set, nothing judged, so INCONCLUSIVE (exit 3)
    with the reason, not "gates passed"."""
    alone = str(REPO / "docs/quality/determinism_bf16_seeds67_alone_h200.json")
    proc = gemctl_in_process("compare", alone, "--max-ne-regression", "0.2%", "--no-plot",
                             cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "no arm besides the baseline 'bf16' has a finished run to judge" in out
    assert "gates passed" not in out
    results_file(tmp_path / "two.json", [0.0, 0.0])
    body = json.loads(gemctl_in_process("compare", "two.json", "--arms", "base", "--json",
                                        "--max-ne-regression", "0.1%", "--no-plot",
                                        cwd=tmp_path).stdout)
    (v,) = body["verdicts"]
    assert v["verdict"] == "inconclusive" and v["unjudged"] and body["exit_code"] == 3
    # without a gate there is nothing to fool: exit 0, no verdicts
    assert gemctl_in_process("compare", alone, "--no-plot", cwd=tmp_path).returncode == 0


def test_an_arm_a_results_file_names_without_a_trial_is_inconclusive(tmp_path: Path):
    """An in-process sweep cut short before any fp8 trial finished: its file's header names
    the arm; the gates say it was not judged (exit 3) instead of passing on the others."""
    results_file(tmp_path / "cut.json", [0.0, 0.01, -0.01])
    trials, header = load_results(tmp_path / "cut.json")
    write_results(tmp_path / "cut.json",
                  {**header, "arms": {"base": [], "arm": ["x=1"], "fp8": ["y=2"]}}, trials)
    proc = gemctl_in_process("compare", "cut.json", "--max-ne-regression", "0.1%", "--no-plot",
                             cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "arm 'fp8': no finished run to judge (an arm of cut.json)" in out
    assert gemctl_in_process("compare", "cut.json", "--arms", "arm", "--max-ne-regression",
                             "0.1%", "--no-plot", cwd=tmp_path).returncode == 0


def test_one_arm_name_for_two_recipes_is_refused(tmp_path: Path):
    """Two results files that mean different recipes by the arm 'arm' (their headers'
    fingerprints differ) are not pooled into one arm: exit 2 naming the arm and both files.
    The same recipe in both (a file and its continuation) compares as one arm."""
    for name, fingerprint in (("a", "f00d"), ("b", "beef"), ("c", "f00d")):
        results_file(tmp_path / f"{name}.json", [0.0, 0.01])
        trials, header = load_results(tmp_path / f"{name}.json")
        trials = [t for t in trials if name == "a" or t.arm == "arm"]
        write_results(tmp_path / f"{name}.json",
                      {**header, "recipes": {"base": "0", "arm": fingerprint}}, trials)
    proc = gemctl_in_process("compare", "a.json", "b.json", "--no-plot", cwd=tmp_path)
    assert proc.returncode == 2
    err = " ".join(proc.stderr.split())
    assert "Arm 'arm' is one recipe in a.json and another in b.json" in err
    assert gemctl_in_process("compare", "a.json", "c.json", "--no-plot",
                             cwd=tmp_path).returncode == 0
