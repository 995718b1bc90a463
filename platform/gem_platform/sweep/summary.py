"""The comparison a sweep's parent run carries, so the sweep reads like one run in MLflow and
in ``gemctl runs --sweeps``:

- metrics: the baseline arm's means under the plain names (``eval/ne_ctr``, ...), each arm's
  means as ``arm/<arm>/<metric>``, its delta to the baseline and interval as
  ``delta/<arm>/<metric>`` (``_low``, ``_high``), and each gate's verdict as
  ``gate/<arm>/<metric>`` = the exit code it stands for (0 pass, 1 fail, 3 inconclusive);
- tags: ``gem.gates`` (pass / fail / inconclusive overall) and ``gem.git_commits`` (the commits
  its trials trained with);
- artifacts: ``comparison.json`` (``gemctl compare --json``'s form, which ``gemctl compare``
  reads back), ``comparison_table.json`` (one row per arm, task and metric, an MLflow
  table the UI shows) and ``quality.md`` (the quality report, ``gemctl compare --markdown``).
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

from gem_platform.sweep.compare import Comparison
from gem_platform.sweep.gates import EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_PASS, exit_code
from gem_platform.sweep.report import quality_markdown

VERDICT_CODE = {"pass": EXIT_PASS, "fail": EXIT_FAIL, "inconclusive": EXIT_INCONCLUSIVE}
OVERALL = {EXIT_PASS: "pass", EXIT_FAIL: "fail", EXIT_INCONCLUSIVE: "inconclusive"}


def _key(*parts: str) -> str:
    """An MLflow metric name: characters it refuses (',', '=' of grid arm names) become '_'."""
    return re.sub(r"[^\w./ -]", "_", "/".join(parts))


def comparison_metrics(cmp: Comparison) -> dict[str, float]:
    out: dict[str, float] = {}
    for arm in cmp.arms:
        for name, summary in arm.metrics.items():
            if math.isnan(summary.mean):
                continue
            out[_key("arm", arm.arm, name)] = summary.mean
            if arm.arm == cmp.baseline:
                out[name] = summary.mean
        for name, d in arm.deltas.items():
            for suffix, value in (("", d.value), ("_low", d.low), ("_high", d.high)):
                if math.isfinite(value):
                    out[_key("delta", arm.arm, name) + suffix] = value
    for v in cmp.verdicts:
        out[_key("gate", v.arm, v.metric)] = float(VERDICT_CODE[v.verdict])
    return out


def comparison_table(cmp: Comparison) -> dict[str, list[Any]]:
    """Columns of one row per (arm, metric): mean, std, seeds, each seed's value, delta and
    interval, verdict (empty where ungated)."""
    verdicts = {(v.arm, v.metric): v.verdict for v in cmp.verdicts}
    cols: dict[str, list[Any]] = {k: [] for k in ("arm", "metric", "mean", "std", "seeds",
                                                  "per_seed", "delta", "low", "high",
                                                  "verdict")}

    def num(x: float) -> float | None:
        return None if math.isnan(x) else x

    for arm in cmp.arms:
        for name, s in arm.metrics.items():
            if s.n == 0:
                continue
            d = arm.deltas.get(name)
            row = {"arm": arm.arm, "metric": name, "mean": s.mean, "std": num(s.std),
                   "seeds": s.n, "per_seed": " ".join(
                       f"{seed}:{v:.6g}" for seed, v in zip(arm.seeds, arm.per_seed[name],
                                                             strict=False) if v is not None),
                   "delta": num(d.value) if d else None, "low": num(d.low) if d else None,
                   "high": num(d.high) if d else None,
                   "verdict": verdicts.get((arm.arm, name), "")}
            for k, v in row.items():
                cols[k].append(v)
    return cols


def log_comparison(uri: str, parent_run_id: str, cmp: Comparison) -> None:
    """Record ``cmp`` on the sweep's parent run (metrics, tags, artifacts; see the module)."""
    import json

    from mlflow.entities import Metric

    from gem_platform.sweep import store

    c = store.client(uri)
    now = int(time.time() * 1000)
    items = [Metric(k, v, now, 0) for k, v in comparison_metrics(cmp).items()]
    for i in range(0, len(items), 500):
        c.log_batch(parent_run_id, metrics=items[i : i + 500])
    if cmp.verdicts:
        c.set_tag(parent_run_id, "gem.gates", OVERALL[exit_code(cmp.verdicts)])
    commits = sorted({v for arm in cmp.arms for v in arm.commits.values()})
    if commits:
        c.set_tag(parent_run_id, "gem.git_commits", ",".join(commits))
    c.log_dict(parent_run_id, json.loads(json.dumps(cmp.to_dict(), default=str)),
               "comparison.json")
    c.log_table(parent_run_id, comparison_table(cmp), "comparison_table.json")
    c.log_text(parent_run_id, quality_markdown(cmp), "quality.md")
