"""gemctl bench looks: a gate read at several seed counts, and the level that keeps a false
PASS at 2.5% over all of them; checked against the committed precision ablation, whose
fp8_b32 CTR gate was read at nine seed counts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gem_bench.looks import _t_statistics, false_claim_rate, sequential_level
from gem_platform.errors import GemError
from gem_platform.sweep.results import load_results, write_results
from gemctl.main import app
from tests.conftest import REPO

PRECISION = REPO / "docs/quality/ablation_precision_h200.json"
FP8_B32_LOOKS = [5, 8, 20, 23, 30, 35, 37, 40, 51]  # the committed file's history (git log)


def test_one_look_keeps_the_gates_own_level():
    level, nominal = sequential_level([30])
    assert level == pytest.approx(0.975, abs=0.002)
    assert nominal == pytest.approx(0.025, abs=0.002)


def test_more_looks_need_a_stricter_level_yet_less_than_bonferroni():
    level, nominal = sequential_level(FP8_B32_LOOKS)
    assert 0.08 < nominal < 0.12  # nine looks at 95% each: a false PASS four times as often
    assert 0.975 < level < 1 - 0.025 / len(FP8_B32_LOOKS)
    # on draws the level was not fitted to, it holds the rate at 2.5%
    fresh = _t_statistics(FP8_B32_LOOKS, 100_000, seed=1)
    assert false_claim_rate(fresh, FP8_B32_LOOKS, level) == pytest.approx(0.025, abs=0.002)


def test_looks_need_an_interval():
    with pytest.raises(GemError, match="at least one look"):
        sequential_level([0, 1])


def _looks(tmp_path, *args: str) -> dict:
    result = CliRunner().invoke(app, ["bench", "looks", str(PRECISION), *args,
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    return json.loads((tmp_path / "looks_bench.json").read_text())


def test_the_committed_fp8_gates_read_after_their_looks(tmp_path):
    """fp8_b32's CTR PASS at 51 seeds holds at the level for its nine looks (top 0.186%) but
    not under Bonferroni (0.201%); fp8_b128's CTR PASS at 12 seeds, read at 5 and 8 before,
    does not hold at the level for its three looks (top 0.204%); its CVR PASS does."""
    b32 = _looks(tmp_path, "--arm", "fp8_b32", "--looks", "5,8,20,23,30,35,37,40")
    assert b32["looks"] == FP8_B32_LOOKS and b32["baseline"] == "bf16"
    gate, one_level, bonferroni = b32["readings"]
    assert (gate["confidence"], round(gate["low"], 3), round(gate["high"], 3)) == (
        0.95, -0.089, 0.148)  # the gate's own interval, as gemctl compare prints it
    assert [r["verdict"] for r in b32["readings"]] == ["PASS", "PASS", "INCONCLUSIVE"]
    assert one_level["high"] == pytest.approx(0.186, abs=0.002)
    assert bonferroni["high"] == pytest.approx(0.201, abs=0.001)
    b128 = _looks(tmp_path, "--arm", "fp8_b128", "--looks", "5,8")
    assert b128["looks"] == [5, 8, 12]
    assert [r["verdict"] for r in b128["readings"]] == ["PASS", "INCONCLUSIVE", "INCONCLUSIVE"]
    assert b128["readings"][1]["high"] == pytest.approx(0.204, abs=0.002)
    cvr = _looks(tmp_path, "--arm", "fp8_b128", "--looks", "5,8", "--metric", "ne_cvr")
    assert [r["verdict"] for r in cvr["readings"]] == ["PASS", "PASS", "PASS"]


@pytest.mark.parametrize("args, words", [
    (["--arm", "fp8_b32", "--metric", "auc_ctr"], "reads NE gates"),
    (["--arm", "fp8_b32", "--looks", "5,x"], "comma-separated list of seed counts"),
    (["--arm", "no_such_arm"], "--arms no_such_arm: not among"),
])
def test_bad_arguments_name_what_is_wrong(tmp_path, args, words):
    result = CliRunner().invoke(app, ["bench", "looks", str(PRECISION), *args,
                                      "--out", str(tmp_path)])
    assert result.exit_code == 2 and words in result.output
    assert not (tmp_path / "looks_bench.json").exists()


def test_the_looks_default_to_the_files_rounds(tmp_path):
    """Without --looks the paired counts after each of the file's rounds are the looks: the
    committed file with the rounds its fp8_b32 seeds came in reads as with them passed by
    hand; the committed file itself predates rounds, and the command says to pass them."""
    trials, header = load_results(PRECISION)
    header.pop("format")
    batches = [range(a, b) for a, b in zip([0, *FP8_B32_LOOKS[:-1]], FP8_B32_LOOKS, strict=True)]
    header["rounds"] = [[f"{arm}/{s}" for s in batch for arm in ("bf16", "fp8_b32")]
                        for batch in batches]
    rounded = tmp_path / "rounded.json"
    write_results(rounded, header, trials)
    result = CliRunner().invoke(app, ["bench", "looks", str(rounded), "--arm", "fp8_b32",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    body = json.loads((tmp_path / "looks_bench.json").read_text())
    assert body["looks"] == FP8_B32_LOOKS
    assert body["readings"] == _looks(tmp_path, "--arm", "fp8_b32", "--looks",
                                      "5,8,20,23,30,35,37,40")["readings"]
    bare = CliRunner().invoke(app, ["bench", "looks", str(PRECISION), "--arm", "fp8_b32",
                                    "--out", str(tmp_path)])
    assert "records no rounds" in " ".join(bare.output.split())
