"""What a model can reach on synthetic data: AUC ceilings of the planted scorer and its parts.

The planted scorer's AUC on the eval split is the ceiling of any model. Each planted term
alone (recent and long-term affinity, per-id sparse effects, the ad category, dense, and a
world's own terms) gives the ceiling of a model that learned only that signal, so a model's
AUC tells which signals it has and which it misses. The scorer at category level (item
vectors replaced by their category's centroid) is the ceiling of a model that knows items
only by their category: the gap to the full ceiling is what item-level detail is worth. In the
long_range world, the scorer whose long-range term is fitted from the recent and old zones'
category bags (worlds.zone_bag_overlap) is the ceiling of a model that never lets a recent
event attend to an old one: the gap to the full ceiling is all a block-local attention can
lose there. In the lookback world, the scorer whose lookback term is fitted from the zones' category
shares (worlds.zone_lookback_balance) plays that part.
In both, the scorer without the world's own term is what a model blind to it reaches.

CVR figures are over clicked samples, as the conversion label is drawn among clicks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

TaskScores = Mapping[str, Mapping[str, np.ndarray]]  # task -> score name -> (n,) scores

# how the terms are listed (meta.json keeps its keys sorted)
TERM_ORDER = ("intent_affinity", "recent_affinity", "long_affinity", "long_range", "lookback",
              "recall", "sparse_ids", "ad_category", "dense")
PLANTED = "planted"  # the whole planted logit (the ceiling)
CATEGORY_LEVEL = "category_level"  # the planted logit with items known only by category
ZONE_BAGS = "zone_bags"  # long_range, lookback: the world's own term as seen through zone bags
WITHOUT_WORLD_TERM = "without_world_term"  # long_range, lookback, recall: less the world's term
WHOLE = (CATEGORY_LEVEL, ZONE_BAGS, WITHOUT_WORLD_TERM)  # scores of the whole logit
# A run summary's key for its dataset's ceiling without the world's own term, per task: what a
# model blind to that term reaches (gem_platform.sweep.gates reads it)
BLIND_AUC_METRIC = "planted/auc_without_world_term_{task}"


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (ties count one half); NaN when a class is absent."""
    labels = np.asarray(labels).astype(bool)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inv, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    avg_rank = ends - (counts - 1) / 2.0  # 1-based average rank of each distinct score
    rank_sum = float(avg_rank[inv][labels].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def ceiling_aucs(parts: Sequence[TaskScores], ctr: np.ndarray, cvr: np.ndarray
                 ) -> dict[str, dict[str, dict[str, float]]]:
    """AUCs of the scores of every eval shard (``parts``, in the order of the labels).

    Returns ``{"term_auc": {task: {term: auc}}, "category_level_auc": {task: auc}}`` (and
    ``"zone_bags_auc"`` and ``"without_world_term_auc"``, ``{task: auc}``, for the tasks that
    have those scores), the form the dataset's meta keeps them in (``extra``); ``term_auc``
    leaves out the whole scorer, which the meta holds as ``planted_auc``.
    """
    clicked = np.asarray(ctr) == 1
    labels = {"ctr": (np.asarray(ctr), slice(None)), "cvr": (np.asarray(cvr)[clicked], clicked)}
    terms: dict[str, dict[str, float]] = {}
    whole: dict[str, dict[str, float]] = {name: {} for name in WHOLE}
    for task, (y, rows) in labels.items():
        names = parts[0][task].keys()
        for name in names:
            value = auc(np.concatenate([p[task][name] for p in parts])[rows], y)
            if name in whole:
                whole[name][task] = value
            elif name != PLANTED:
                terms.setdefault(task, {})[name] = value
    out = {"term_auc": terms, "category_level_auc": whole[CATEGORY_LEVEL]}
    for name in (ZONE_BAGS, WITHOUT_WORLD_TERM):
        if whole[name]:
            out[f"{name}_auc"] = whole[name]
    return out


def blind_ceilings(extra: Mapping) -> dict[str, float]:
    """task -> the AUC ceiling without the world's own term, for the tasks a dataset's meta
    (``extra``) records one for (the long_range, lookback and recall worlds' CTR)."""
    return {task: float(v) for task, v in extra.get(f"{WITHOUT_WORLD_TERM}_auc", {}).items()}


def describe_ceilings(planted: Mapping[str, float] | None, extra: Mapping) -> list[str]:
    """One line per task: the ceiling, the ceiling at category level and each term alone, as
    a dataset's meta holds them; none for real data, a hint for a synthetic dataset written
    before term ceilings were recorded."""
    if not planted:
        return []
    terms, coarse = extra.get("term_auc"), extra.get("category_level_auc")
    if not terms or not coarse:
        return ["term ceilings: not recorded in this dataset's meta.json (regenerate it with "
                "--force to see them)"]
    lines = []
    for task, ceiling in planted.items():
        known = terms.get(task, {})
        names = sorted(known, key=lambda k: (TERM_ORDER.index(k) if k in TERM_ORDER else 99, k))
        alone = ", ".join(f"{name} {known[name]:.3f}" for name in names)
        bags = extra.get("zone_bags_auc", {}).get(task)
        blind = blind_ceilings(extra).get(task)
        term = next((t for t in ("lookback", "recall") if t in known), "long-range")
        through_bags = "" if bags is None else (
            f", with the {term} term through zone bags (no attention across blocks) "
            f"{bags:.3f}")
        if blind is not None:
            through_bags += f", without the {term} term {blind:.3f}"
        lines.append(f"{task}: ceiling AUC {ceiling:.3f}, at category level "
                     f"{coarse.get(task, float('nan')):.3f}{through_bags}; each term alone: "
                     f"{alone}")
    return lines
