"""Comparison arithmetic: mean +- std over seeds, the interval of the delta to the baseline
(paired over seeds when both arms ran the same seeds, Welch otherwise; checked against
hand-computed values), NE in percent of the baseline, and gates."""

from __future__ import annotations

import math

import pytest

from gem_platform.sweep.compare import (
    Gates,
    TrialRun,
    check_gates,
    compare_trials,
    parse_percent,
)
from gem_platform.sweep.config import SweepError
from gem_platform.sweep.report import quality_markdown
from gem_platform.sweep.results import cross_device_seeds
from gem_platform.sweep.stats import (
    at_confidence,
    paired_delta,
    relative,
    summarize,
    t_quantile,
    welch_delta,
)


def test_welch_interval_matches_hand_computation():
    # a = [1.0, 1.1, 1.2], b = [0.9, 1.0, 1.05]: means 1.1 and 0.98333, variances 0.01 and
    # 0.005833; se^2 = 0.005278; Welch df = 3.741; t(0.975, 3.741) = 2.854 (between the
    # table's 3.182 at df 3 and 2.776 at df 4); scipy's ttest_ind gives low = -0.090668.
    d = welch_delta([1.0, 1.1, 1.2], [0.9, 1.0, 1.05])
    assert d.value == pytest.approx(0.116667, abs=1e-6)
    half = (d.high - d.low) / 2
    assert half == pytest.approx(2.854 * math.sqrt(0.0052778), rel=1e-3)
    assert d.low == pytest.approx(-0.090668, abs=1e-5)


def test_t_quantiles_against_tables():
    for df, expected in ((1, 12.706), (2, 4.303), (5, 2.571), (30, 2.042)):
        assert t_quantile(0.975, df) == pytest.approx(expected, rel=1e-3)


def test_single_seed_has_no_interval():
    s = summarize([1.0])
    assert s.n == 1 and math.isnan(s.std)
    d = welch_delta([1.0], [0.5, 0.6])
    assert d.value == pytest.approx(0.45) and math.isnan(d.low) and math.isnan(d.high)
    assert relative(d, 0.55).value == pytest.approx(0.45 / 0.55 * 100)


def test_paired_interval_matches_hand_computation():
    # differences 0.1, 0.1, 0.15: mean 0.116667, sd 0.028868, se 0.016667, t(0.975, 2) = 4.303
    d = paired_delta([1.0, 1.1, 1.2], [0.9, 1.0, 1.05])
    assert d.method == "paired" and d.value == pytest.approx(0.116667, abs=1e-6)
    assert d.low == pytest.approx(0.116667 - 4.303 * 0.016667, abs=1e-4)
    # the same numbers unpaired: the seed-to-seed spread widens Welch's interval past zero
    assert welch_delta([1.0, 1.1, 1.2], [0.9, 1.0, 1.05]).low < 0 < d.low
    assert relative(d, 0.5).method == "paired"
    with pytest.raises(ValueError, match="one baseline value per arm value"):
        paired_delta([1.0, 2.0], [1.0])


def test_a_paired_interval_read_at_another_confidence():
    """The same differences at 99%: t(0.995, 2) = 9.925 standard errors each side, in percent
    too (the gate's unit); an unpaired or one-seed delta has no such reading."""
    d = paired_delta([1.0, 1.1, 1.2], [0.9, 1.0, 1.05])
    wide = at_confidence(d, 0.99)
    assert wide.value == d.value and wide.high - wide.value == pytest.approx(9.925 * 0.016667,
                                                                          rel=1e-3)
    assert at_confidence(d, 0.95) == d
    assert at_confidence(relative(d, 0.5), 0.99).high == pytest.approx(relative(wide, 0.5).high)
    for unpaired in (welch_delta([1.0, 1.1], [0.9, 1.0]), paired_delta([1.0], [0.9])):
        with pytest.raises(ValueError, match="paired delta over 2 or more seeds"):
            at_confidence(unpaired, 0.99)


def run(arm: str, seed: int, ne: float, auc: float, qps: float) -> TrialRun:
    metrics = {"eval/ne_ctr": ne, "eval/auc_ctr": auc, "eval/ne_cvr": ne, "eval/auc_cvr": auc,
               "perf/qps": qps, "perf/mfu_e2e": 0.1, "balance/padding_waste_mean": 0.2,
               "balance/straggler_overhead_mean": 0.05}
    return TrialRun(f"{arm}{seed}", arm, str(seed), metrics)


@pytest.fixture
def cmp():
    trials = [run("base", 0, 0.800, 0.750, 1000), run("base", 1, 0.802, 0.752, 1010),
              run("worse", 0, 0.810, 0.740, 900), run("worse", 1, 0.812, 0.742, 910),
              run("same", 0, 0.8005, 0.751, 1004), run("same", 1, 0.8015, 0.751, 1006)]
    return compare_trials(trials, "base")


def test_deltas_per_arm(cmp):
    assert [a.arm for a in cmp.arms] == ["base", "worse", "same"] and cmp.tasks == ["ctr", "cvr"]
    worse = cmp.arms[1]
    ne = worse.deltas["eval/ne_ctr"]
    assert ne.value == pytest.approx((0.811 - 0.801) / 0.801 * 100)  # percent of baseline
    assert ne.low > 0  # a regression the interval excludes zero for
    assert worse.deltas["eval/auc_ctr"].value == pytest.approx(-0.010)
    assert worse.deltas["perf/qps"].value == pytest.approx((905 - 1005) / 1005 * 100)
    assert worse.metrics["eval/ne_ctr"].std == pytest.approx(math.sqrt(2e-6))
    assert cmp.arms[0].deltas == {}


def test_an_arm_with_fewer_seeds_is_paired_on_the_seeds_it_shares():
    """A cut-short arm (or one from another sweep) is compared on the seeds both ran: the
    baseline's other seeds, here much higher, do not enter its delta."""
    trials = [run("base", s, ne, 0.75, 1000) for s, ne in enumerate((0.80, 0.81, 0.90, 0.91))]
    trials += [run("short", 0, 0.802, 0.75, 1000), run("short", 1, 0.812, 0.75, 1000)]
    d = compare_trials(trials, "base").arms[1].deltas["eval/ne_ctr"]
    assert d.method == "paired"
    assert d.value == pytest.approx(0.002 / 0.805 * 100)  # percent of the same seeds' mean
    single = compare_trials(trials[:4] + trials[4:5], "base").arms[1].deltas["eval/ne_ctr"]
    assert single.method == "welch"  # one shared seed: nothing to pair an interval on


def test_gates(cmp):
    """Verdicts on the interval: 'worse' lies wholly beyond 0.1% NE (fail), wholly within 2%
    (pass); two seeds with no spread in 'same' still decide."""
    verdicts = check_gates(cmp, Gates(max_ne_regression_pct=0.1))
    fails = {(v.arm, v.metric) for v in verdicts if v.verdict == "fail"}
    assert fails == {("worse", "eval/ne_ctr"), ("worse", "eval/ne_cvr")}
    worse = next(v for v in verdicts if v.arm == "worse")
    assert worse.message.startswith("arm 'worse': NE ctr regression +1.248% [95% CI")
    assert "FAIL, wholly beyond --max-ne-regression 0.1%" in worse.message
    assert {v.verdict for v in check_gates(cmp, Gates(max_ne_regression_pct=2.0))} == {"pass"}
    verdicts = check_gates(cmp, Gates(max_auc_drop=0.005, max_qps_drop_pct=5))
    assert {v.metric for v in verdicts if v.arm == "worse" and v.verdict == "fail"} == \
        {"eval/auc_ctr", "eval/auc_cvr", "perf/qps"}
    assert all(v.verdict == "pass" for v in
               check_gates(cmp, Gates(max_auc_drop=0.02, max_qps_drop_pct=15)))


def test_bad_inputs():
    assert parse_percent("0.1%") == parse_percent("0.1") == 0.1
    for bad in ("abc", "-1%", "nan"):
        with pytest.raises(SweepError):
            parse_percent(bad)
    with pytest.raises(SweepError, match="Baseline arm 'x'"):
        compare_trials([run("a", 0, 1, 1, 1)], "x")
    with pytest.raises(SweepError, match="No finished runs"):
        compare_trials([], None)


def test_pairs_by_seed_only_when_both_arms_ran_the_same_seeds():
    # the seed moves NE by far more than the arm does; paired, the +0.004 shift is clear
    base = [run("base", s, 0.80 + 0.02 * s, 0.75, 1000) for s in range(3)]
    shifted = [run("arm", s, 0.804 + 0.02 * s + 0.0001 * s, 0.75, 1000) for s in range(3)]
    paired = compare_trials(base + shifted, "base").arms[1].deltas["eval/ne_ctr"]
    assert paired.method == "paired" and paired.low > 0
    # seeds that don't match (here 3..5) fall back to Welch, which can't see the shift
    other = [run("arm", s + 3, 0.804 + 0.02 * s, 0.75, 1000) for s in range(3)]
    welch = compare_trials(base + other, "base").arms[1].deltas["eval/ne_ctr"]
    assert welch.method == "welch" and welch.low < 0 < welch.high
    # a seed run twice in one arm (two sweeps of one spec) can't be paired either
    twice = shifted + [run("arm", 0, 0.81, 0.75, 1000)]
    assert compare_trials(base + twice, "base").arms[1].deltas["eval/ne_ctr"].method == "welch"


def test_a_seed_trained_on_two_devices_is_not_paired():
    """The same seed on another card is another sample (its NE moved 0.58% on the committed
    H200/H100 pair, more than a 0.2% gate): a seed whose arm and baseline runs name different
    devices leaves the pairs, and the comparison lists it; unknown devices still pair."""
    from dataclasses import replace

    base = [replace(run("base", s, 0.80 + 0.02 * s, 0.75, 1000), device="H200") for s in range(4)]
    arm = [replace(run("arm", s, 0.801 + 0.02 * s, 0.75, 1000), device="H200") for s in range(3)]
    arm.append(replace(run("arm", 3, 0.80 + 0.06 + 0.005, 0.75, 1000), device="H100"))
    cmp = compare_trials(base + arm, "base")
    result = cmp.arms[1]
    assert cross_device_seeds(result.devices, cmp.arms[0].devices) == ["3"]
    d = result.deltas["eval/ne_ctr"]
    assert d.method == "paired" and d.n == 3  # seeds 0-2, not 3
    assert d.value == pytest.approx(0.001 / 0.82 * 100)
    unknown = [replace(r, device=None) for r in arm]
    again = compare_trials(base + unknown, "base")
    assert cross_device_seeds(again.arms[1].devices, again.arms[0].devices) == []
    assert again.arms[1].deltas["eval/ne_ctr"].n == 4


def test_quality_markdown(cmp):
    """The report: a verdict column per task only where an NE gate was judged, FAIL and PASS
    in bold, the baseline's row without deltas, a pipe in an arm's name escaped."""
    plain = quality_markdown(cmp).splitlines()
    assert plain[0] == ("| arm | seeds | NE ctr | ΔNE ctr [95% CI] | AUC ctr | "
                        "ΔAUC ctr [95% CI] | NE cvr | ΔNE cvr [95% CI] | AUC cvr | "
                        "ΔAUC cvr [95% CI] |")
    assert plain[2].startswith("| base | 2 | 0.8010±0.0014 |  | 0.7510±0.0014 |  |")
    cmp.verdicts = check_gates(cmp, Gates(max_ne_regression_pct=0.1))
    rows = {r.split(" | ")[0]: r.split(" | ") for r in quality_markdown(cmp).splitlines()}
    assert rows["| arm"][4] == "verdict"
    assert rows["| worse"][4] == "**FAIL**" and rows["| worse"][3].startswith("+1.248% [")
    assert rows["| same"][4] == "INCONCLUSIVE, ~6 seeds (~24 if the mean moves 1 SE closer)"
    piped = compare_trials([run("a|b", 0, 0.8, 0.75, 1), run("base", 0, 0.8, 0.75, 1)], "base")
    assert "| a\\|b | 1 |" in quality_markdown(piped)


def test_arms_trained_past_one_epoch_are_named(tmp_path):
    """Runs record the epochs they trained (train/epochs); a comparison names the arms with a
    run past one, in its JSON and in words, since their NEs can measure memorization. Runs
    that did not record it (older ones) name nothing."""
    import json

    from gem_platform.sweep.results import write_results
    from tests.conftest import gemctl_in_process

    trials = [run("base", s, 0.80 + s / 1000, 0.75, 1000) for s in range(2)]
    trials += [run("long", s, 0.81 + s / 1000, 0.74, 1000) for s in range(2)]
    assert compare_trials(trials, "base").past_one_epoch == {}
    for t in trials:
        t.metrics["train/epochs"] = 0.85 if t.arm == "base" else 1.0 + 1.4 * int(t.seed)
    cmp = compare_trials(trials, "base")
    assert cmp.past_one_epoch == {"long": pytest.approx(2.4)}
    assert cmp.to_dict()["past_one_epoch"] == {"long": pytest.approx(2.4)}
    write_results(tmp_path / "r.json", {"sweep": "r", "baseline": "base"}, trials)
    shown = gemctl_in_process("compare", "r.json", "--no-plot", cwd=tmp_path)
    assert "trained past one epoch of the training split" in shown.stdout
    assert "long 2.4" in shown.stdout and "base 0.8" not in shown.stdout
    as_json = gemctl_in_process("compare", "r.json", "--no-plot", "--json", cwd=tmp_path)
    assert json.loads(as_json.stdout)["past_one_epoch"] == {"long": pytest.approx(2.4)}
