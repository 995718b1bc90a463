"""What docs/quality/README.md says of the committed H200 ablation results, checked against the
files: the attention ablation's verdicts, that the recipe trains to the same bits in
different calls and processes, that the written tables (these and the CPU controls') are
`gemctl compare --markdown` of their files, and `gemctl compare --arms` on them."""

from __future__ import annotations

import json

import pytest

from gem_platform.sweep.compare import compare
from gem_platform.sweep.gates import Gates
from gem_platform.sweep.results import load_results
from gemctl.comparison_view import seed_spans
from tests.conftest import REPO, gemctl_in_process

QUALITY = REPO / "docs/quality"


def test_every_attention_arm_passes_the_gate_on_both_tasks():
    """ablation_attention_h200.json: sliding (14 seeds) and block64 (30 seeds) within 0.2% of
    full attention's held-out NE on CTR and CVR; block64's CVR cost is real (its interval
    clears zero) but below the gate."""
    result = compare("", [str(QUALITY / "ablation_attention_h200.json")],
                     gates=Gates(max_ne_regression_pct=0.2))
    verdicts = {(v.arm, v.metric): v for v in result.verdicts}
    assert {k: v.verdict for k, v in verdicts.items()} == {
        (arm, f"eval/ne_{task}"): "pass" for arm in ("sliding", "block64")
        for task in ("ctr", "cvr")}
    assert verdicts["block64", "eval/ne_ctr"].seeds == 30
    cvr = verdicts["block64", "eval/ne_cvr"]
    assert 0 < cvr.low < cvr.high < 0.2  # percent


def test_the_recipe_trains_to_the_same_bits_in_another_call():
    """determinism_bf16_seeds67_alone_h200.json: precision's bf16 arm is the attention sweep's
    block64 arm (one resolved recipe); trained alone in a later call, seeds 6 and 7 repeat
    the attention sweep's at every logged step and in every held-out score, while the
    precision sweep's bf16 6-7 (trained beside FP8 trials) differ from the first step."""
    alone, _ = load_results(QUALITY / "determinism_bf16_seeds67_alone_h200.json")
    attention, _ = load_results(QUALITY / "ablation_attention_h200.json")
    precision, _ = load_results(QUALITY / "ablation_precision_h200.json")
    block64 = {t.seed: t for t in attention if t.arm == "block64"}
    bf16 = {t.seed: t for t in precision if t.arm == "bf16"}
    assert sorted(t.seed for t in alone) == ["6", "7"]
    for t in alone:
        first = block64[t.seed]
        assert t.history == first.history
        assert {k: v for k, v in t.metrics.items() if k.startswith("eval/")} == {
            k: v for k, v in first.metrics.items() if k.startswith("eval/")}
        odd = bf16[t.seed].history["train/loss"]
        assert odd[0][1] != t.history["train/loss"][0][1]


def test_the_card_not_the_commit_moved_a_seed():
    """determinism_bf16_s0_{15f2470,d078bc5}_h100.json: precision's bf16 seed 0 trained on one
    H100 from commit 15f2470's tree and from d078bc5's, side by side, on the same dataset:
    the same bits at every logged step; the committed H200 trial of commit 15f2470 differs.
    So a seed on another card is another sample, and the precision file's pairs share a card."""
    old, old_header = load_results(QUALITY / "determinism_bf16_s0_15f2470_h100.json")
    new, new_header = load_results(QUALITY / "determinism_bf16_s0_d078bc5_h100.json")
    precision, header = load_results(QUALITY / "ablation_precision_h200.json")
    (old,), (new,) = old, new
    h200 = next(t for t in precision if (t.arm, t.seed) == ("bf16", "0"))
    assert old.commit.startswith("15f2470") and new.commit.startswith("d078bc5")
    assert h200.commit == old.commit and h200.device == "NVIDIA H200"
    assert {old.device, new.device} == {"NVIDIA H100 80GB HBM3"}
    digests = {next(iter(h["provenance"]["datasets"].values()))["digest"]
               for h in (old_header, new_header, header)}
    assert len(digests) == 1
    assert old.history == new.history and old.metrics["eval/ne_ctr"] == new.metrics["eval/ne_ctr"]
    assert abs(h200.metrics["eval/ne_ctr"] - old.metrics["eval/ne_ctr"]) > 0.004
    assert h200.history["train/loss"][0] != old.history["train/loss"][0]
    pairs = {}
    for t in precision:
        pairs.setdefault(t.seed, set()).add(t.device)
    assert all(len(devices) == 1 for devices in pairs.values())  # both arms of a seed, one card


def test_a_shared_compile_cache_moved_a_whole_trial():
    """compile_cache_trial_{shared,own}_h100.json: h200's bf16 seed 0 on one H100 after a
    4x-shorter-history world compiled first; from a cache folder shared with that world it
    trained to other bits (0.9% of CTR NE), from the recipe's own folder to the bits it gives
    alone from two commits' trees (determinism_bf16_s0_*_h100.json)."""
    (shared,), shared_header = load_results(QUALITY / "compile_cache_trial_shared_h100.json")
    (own,), own_header = load_results(QUALITY / "compile_cache_trial_own_h100.json")
    (alone,), alone_header = load_results(QUALITY / "determinism_bf16_s0_d078bc5_h100.json")
    assert {shared.device, own.device, alone.device} == {"NVIDIA H100 80GB HBM3"}
    assert shared_header["recipes"] == own_header["recipes"] == alone_header["recipes"]
    assert own.history == alone.history and own.metrics["eval/ne_ctr"] == \
        alone.metrics["eval/ne_ctr"] == pytest.approx(0.8815614)
    assert shared.metrics["eval/ne_ctr"] / own.metrics["eval/ne_ctr"] - 1 < -0.009


def test_compare_answers_only_the_named_arms(tmp_path):
    """`gemctl compare FILE --baseline block64 --arms sliding`: full (+0.52% CTR NE against
    block64) FAILs the gate when every arm is compared; named arms alone decide the exit code,
    and a name the file lacks is a clear error."""
    file = str(QUALITY / "ablation_attention_h200.json")
    every = gemctl_in_process("compare", file, "--baseline", "block64", "--no-plot", "--json",
                              "--max-ne-regression", "0.2%", cwd=tmp_path)
    assert every.returncode == 1
    assert {a["arm"] for a in json.loads(every.stdout)["arms"]} == {"block64", "full",
                                                                    "sliding"}
    sliding = gemctl_in_process("compare", file, "--arms", "sliding",
                                "--max-ne-regression", "0.2%", cwd=tmp_path)
    assert sliding.returncode == 0, sliding.stdout + sliding.stderr
    assert "gates passed" in sliding.stdout
    # its plot is named for the narrowed arms, beside (not over) the whole comparison's
    assert (tmp_path / "gem_runs/compare/ablation_attention_h200-sliding-ne.png").is_file()
    assert "block64" not in sliding.stdout.split("runs from")[0]
    # one entry per commit, seeds as spans
    assert "15f2470c65: full seeds 0-7, sliding seeds 0-7;" in sliding.stdout
    unknown = gemctl_in_process("compare", file, "--arms", "fp8", "--no-plot", cwd=tmp_path)
    assert unknown.returncode == 2
    assert "--arms fp8: not among" in unknown.stderr and "block64, full, sliding" in unknown.stderr


def test_seed_spans():
    assert seed_spans(["0", "1", "2", "4", "6", "7", "x"]) == "0-2, 4, 6-7, x"
    assert seed_spans([]) == ""


@pytest.mark.parametrize("name, options, code", [
    ("ablation_attention_h200", [], 0),
    ("ablation_precision_h200", [], 0),
    ("recall_controls_demo", [], 1),  # the positive control: block64 FAILs
    ("recall_controls_rope_demo", [], 1),
    ("local_controls_demo", ["--baseline", "full_local"], 0),
    ("attention_rope_h100", [], 3),
    ("attention_rope_h100", ["--baseline", "block64", "--arms", "block64_no_rope"], 1),
    ("recall_h200_newest", ["--baseline", "full_newest", *(
        f"--expect={arm}:{m}" for arm in ("block64_newest", "block64_rope_newest",
                                          "sliding_newest")
        for m in ("ne_ctr=fail", "ne_cvr=pass"))], 3),  # full_rope_newest: no expectation
])
def test_the_written_tables_are_the_files_own(name, options, code, tmp_path):
    """docs/quality/README.md holds `gemctl compare FILE --max-ne-regression 0.2% --markdown`
    of each committed ablation and control as printed: a seed added to a file without its
    table, or a figure edited by hand, fails here."""
    out = gemctl_in_process("compare", str(QUALITY / f"{name}.json"), *options, "--markdown",
                            "--max-ne-regression", "0.2%", cwd=tmp_path)
    assert out.returncode == code, out.stdout + out.stderr
    table = out.stdout
    assert table.startswith("| arm | seeds | NE ctr | ΔNE ctr [95% CI] | verdict |")
    assert table in (QUALITY / "README.md").read_text()
    assert not (tmp_path / "gem_runs").exists()  # a report writes no plots unless asked


def test_markdown_and_json_are_one_or_the_other(tmp_path):
    out = gemctl_in_process("compare", str(QUALITY / "ablation_attention_h200.json"),
                            "--markdown", "--json", cwd=tmp_path)
    assert out.returncode == 2 and "Pass one of them" in out.stderr
