"""A control's expected verdicts: block-local attention on data that plants what it can't see
must FAIL there and PASS on a task without it. The expected verdict counts as a pass, the
opposite as a fail (the control is broken), anything else as inconclusive, and an expectation
no gate judged is never a pass by omission."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from gem_platform.errors import GemError
from gem_platform.sweep.config import load_sweep
from gem_platform.sweep.gates import (
    EXIT_FAIL,
    EXIT_INCONCLUSIVE,
    EXIT_PASS,
    FAIL,
    INCONCLUSIVE,
    PASS,
    Expectation,
    Verdict,
    exit_code,
    expect_verdicts,
)
from tests.conftest import REPO, gemctl_in_process

RECALL = REPO / "docs/quality/recall_h200_newest.json"
# one blind arm against the baseline (the file holds more, each FAILing CTR)
PAIR = ["--arms", "block64_newest"]
NIGHTLY = REPO / "deploy/scripts/nightly-ablations.sh"
# the script's python3 reads YAML: this environment's, which has the project's PyYAML
SCRIPT_ENV = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}


def _verdict(arm: str, metric: str, word: str) -> Verdict:
    return Verdict(arm, metric, word, 1.0, 0.5, 1.5, 0.2, "%", 2, None, f"{arm} {metric}")


def test_expectations_parse_and_name_eval_metrics():
    assert Expectation.parse("block64:ne_ctr=FAIL") == Expectation("block64", "eval/ne_ctr", FAIL)
    assert Expectation.parse("a:b:perf/qps=pass") == Expectation("a:b", "perf/qps", PASS)
    for bad in ("block64", "block64:ne_ctr", "block64:ne_ctr=maybe", ":ne_ctr=fail"):
        with pytest.raises(GemError, match="ARM:METRIC=pass|fail"):
            Expectation.parse(bad)


@pytest.mark.parametrize(("got", "want", "counts", "told"), [
    (FAIL, FAIL, EXIT_PASS, "it holds"),
    (PASS, PASS, EXIT_PASS, "it holds"),
    (PASS, FAIL, EXIT_FAIL, "the control is broken"),
    (FAIL, PASS, EXIT_FAIL, "the control is broken"),
    (INCONCLUSIVE, FAIL, EXIT_INCONCLUSIVE, "not settled"),
])
def test_an_expected_verdict_counts_by_whether_it_holds(got, want, counts, told):
    (marked,) = expect_verdicts([_verdict("block64", "eval/ne_ctr", got)],
                                [Expectation("block64", "eval/ne_ctr", want)])
    assert marked.expected == want and marked.verdict == got
    assert exit_code([marked]) == counts and told in marked.message


def test_other_verdicts_stand_and_an_unjudged_expectation_is_inconclusive():
    plain = _verdict("sliding", "eval/ne_ctr", FAIL)
    out = expect_verdicts([plain], [Expectation("block64", "eval/ne_cvr", PASS)])
    assert out[0] is plain and exit_code([out[0]]) == EXIT_FAIL
    missing = out[1]
    assert (missing.arm, missing.metric, missing.verdict) == ("block64", "eval/ne_cvr",
                                                              INCONCLUSIVE)
    assert missing.unjudged and math.isnan(missing.regression)
    assert exit_code([missing]) == EXIT_INCONCLUSIVE


def test_the_committed_gpu_control_holds_and_a_wrong_expectation_fails(tmp_path):
    """docs/quality/recall_h200_newest.json with the spec's expectations: block64 FAILs CTR
    and PASSes CVR as the control expects (exit 0, where the bare gate exits 1); expecting it
    to pass CTR says the control is broken (exit 1)."""
    gate = ["compare", str(RECALL), "--baseline", "full_newest", "--max-ne-regression",
            "0.2%", "--no-plot", *PAIR]
    assert gemctl_in_process(*gate, cwd=tmp_path).returncode == EXIT_FAIL
    held = gemctl_in_process(*gate, "--expect", "block64_newest:ne_ctr=fail",
                             "--expect", "block64_newest:ne_cvr=pass", cwd=tmp_path)
    assert held.returncode == EXIT_PASS, held.stderr
    assert "FAIL (as expected)" in held.stdout and "it holds" in held.stdout + held.stderr
    broken = gemctl_in_process(*gate, "--expect", "block64_newest:ne_ctr=pass", cwd=tmp_path)
    assert broken.returncode == EXIT_FAIL and "the control is broken" in broken.stderr
    typo = gemctl_in_process(*gate, "--expect", "block46_newest:ne_ctr=fail", cwd=tmp_path)
    assert typo.returncode == 2 and "names arm 'block46_newest'" in typo.stderr
    no_gate = gemctl_in_process("compare", str(RECALL), "--baseline", "full_newest",
                                "--expect", "block64_newest:ne_ctr=fail", "--no-plot", *PAIR,
                                cwd=tmp_path)
    assert no_gate.returncode == 2 and "no gate is set" in no_gate.stderr


def test_the_recall_spec_carries_its_expectations_to_the_gates_and_the_nightly_run():
    plan = load_sweep(REPO / "recipes/ablations/recall_h200.yaml")
    assert set(plan.gates.expect) == {
        Expectation("block64_newest", "eval/ne_ctr", FAIL),
        Expectation("block64_newest", "eval/ne_cvr", PASS),
        Expectation("block64_rope_newest", "eval/ne_ctr", FAIL),
        Expectation("block64_rope_newest", "eval/ne_cvr", PASS),
        Expectation("sliding_newest", "eval/ne_ctr", FAIL),
        Expectation("sliding_newest", "eval/ne_cvr", PASS)}
    lines = subprocess.run(
        ["bash", "-c", f'source "{NIGHTLY}"; expect_args recipes/ablations/recall_h200.yaml'],
        cwd=REPO, capture_output=True, text=True, check=True, env=SCRIPT_ENV).stdout.split()
    assert lines[:2] == ["--expect", "block64_newest:ne_ctr=fail"] and len(lines) == 12
    none = subprocess.run(
        ["bash", "-c", f'source "{NIGHTLY}"; expect_args recipes/ablations/attention.yaml'],
        cwd=REPO, capture_output=True, text=True, check=True, env=SCRIPT_ENV).stdout
    assert none == ""


def test_a_spec_cannot_expect_a_verdict_of_an_arm_it_does_not_have(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: s\nbase: {REPO / 'recipes/demo.yaml'}\narms: {{a: [], b: []}}\n"
                    "gates: {expect: {c: {ne_ctr: fail}}}\n")
    with pytest.raises(GemError, match="gates.expect names 'c', which is not an arm"):
        load_sweep(spec)


def test_the_nightly_verdict_lines_say_what_a_control_expected(tmp_path):
    proc = gemctl_in_process("compare", str(RECALL), "--baseline", "full_newest",
                             "--max-ne-regression", "0.2%", "--expect",
                             "block64_newest:ne_ctr=fail", "--no-plot", "--json", *PAIR,
                             cwd=tmp_path)
    assert proc.returncode == EXIT_PASS, proc.stderr
    (tmp_path / "cmp.json").write_text(proc.stdout)
    lines = subprocess.run(
        ["bash", "-c", f'source "{NIGHTLY}"; verdicts "{tmp_path / "cmp.json"}"'],
        capture_output=True, text=True, check=True).stdout.splitlines()
    assert "block64_newest eval/ne_ctr FAIL (expected FAIL)" in lines
    assert "block64_newest eval/ne_cvr PASS" in lines


def test_a_sweep_of_some_arms_leaves_the_other_controls_unjudged():
    """A spec's expectations on arms the comparison does not hold (a sweep run with --arms on
    part of its arms) add no verdict: only the compared arms' controls are judged."""
    from gem_platform.sweep.compare import compare
    from gem_platform.sweep.gates import Gates

    gates = Gates(max_ne_regression_pct=0.2, expect=(
        Expectation("block64_newest", "eval/ne_ctr", FAIL),
        Expectation("sliding_newest", "eval/ne_ctr", FAIL)))
    verdicts = compare("", [str(RECALL)], baseline="full_newest", gates=gates,
                       arms=["block64_newest"]).verdicts
    assert {(v.arm, v.metric, v.expected) for v in verdicts} == {
        ("block64_newest", "eval/ne_ctr", FAIL), ("block64_newest", "eval/ne_cvr", None)}
    assert exit_code(verdicts) == EXIT_PASS
