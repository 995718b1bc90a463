"""An ablation's quality report as a Markdown table, made from its comparison: per arm and task
the held-out NE and AUC with their deltas to the baseline, 95% intervals and the NE gate's
verdict. Written docs paste it as printed (`gemctl compare ... --markdown`), so a committed
table is the results file's own numbers and a test can hold the two together."""

from __future__ import annotations

from collections.abc import Sequence

from gem_platform.sweep.compare import ArmResult, Comparison
from gem_platform.sweep.gates import FAIL, INCONCLUSIVE, PASS, Verdict, settle_words
from gem_platform.sweep.stats import Delta, Summary, delta_text, mean_sd


def _cell(text: str) -> str:
    """A table cell: pipes escaped, line breaks folded."""
    return " ".join(text.replace("|", "\\|").split())


def _mean_sd(s: Summary | None) -> str:
    return "-" if s is None else mean_sd(s.mean, s.std)


def _verdict(v: Verdict | None, delta: Delta | None) -> str:
    """PASS / FAIL in bold ("better" where the whole NE interval is below zero), an
    inconclusive one with the seeds that would settle it and, where the runs recorded their
    time, what those trials cost."""
    if v is None:
        return ""
    if v.verdict == INCONCLUSIVE:
        return "INCONCLUSIVE" + (f", {settle_words(v)}" if v.seeds_needed else "")
    better = v.verdict == PASS and delta is not None and delta.high < 0
    word = {PASS: "PASS", FAIL: "FAIL"}[v.verdict]
    expected = ("" if v.expected is None else " (as expected)" if v.expected == v.verdict
                else f" (expected {v.expected.upper()})")
    return f"**{word}**" + (" (better)" if better else "") + expected


def _row(arm: ArmResult, tasks: Sequence[str], ne_gate: dict[tuple[str, str], Verdict],
         gated: bool) -> list[str]:
    seeds = max((arm.metrics[f"eval/ne_{t}"].n for t in tasks
                 if f"eval/ne_{t}" in arm.metrics), default=len(arm.seeds))
    cells = [_cell(arm.arm), str(seeds)]
    for task in tasks:
        ne, auc = f"eval/ne_{task}", f"eval/auc_{task}"
        cells += [_mean_sd(arm.metrics.get(ne)), delta_text(arm.deltas.get(ne), "%", 3)]
        if gated:
            cells.append(_verdict(ne_gate.get((arm.arm, ne)), arm.deltas.get(ne)))
        cells += [_mean_sd(arm.metrics.get(auc)), delta_text(arm.deltas.get(auc), "", 4)]
    return cells


def quality_markdown(cmp: Comparison) -> str:
    """The comparison's quality table in Markdown, the baseline's row first; a verdict column
    per task where an NE gate was judged."""
    ne_gate = {(v.arm, v.metric): v for v in cmp.verdicts if v.metric.startswith("eval/ne_")}
    gated = bool(ne_gate)
    head = ["arm", "seeds"]
    for task in cmp.tasks:
        head += [f"NE {task}", f"ΔNE {task} [95% CI]"]
        head += ["verdict"] if gated else []
        head += [f"AUC {task}", f"ΔAUC {task} [95% CI]"]
    rows = [head, ["---"] * len(head)]
    rows += [_row(arm, cmp.tasks, ne_gate, gated) for arm in cmp.arms]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"
