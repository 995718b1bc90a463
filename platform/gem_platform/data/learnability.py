"""How much of the planted signal a synthetic dataset lets a model learn: samples per id.

A per-id effect (a user's bias, a region's, a tag's) can only be learned from the training
samples that carry the id. This module draws a recipe's synthetic dataset in memory (the same
samples ``gemctl data generate`` writes) and reports, per kind of id, how many training
samples each id has, and the AUC ceilings that follow:

- ``planted``: the planted scorer (the dataset's ``planted_auc``);
- ``ids_as_learnable``: every per-id effect replaced by what an ideal learner could estimate
  from that id's training samples: the Gaussian posterior mean under the planted prior
  (effects ~ N(0, SPARSE_EFFECT_STD^2)), with the estimation noise drawn, from the Fisher
  information the id's samples carry (sum over them of w^2 p (1 - p), w the id's weight in
  the logit: 1, or 1/k for one of k ids of a multi-hot feature; CVR over clicked samples);
- ``category_level``: items known only by their category (no item-level detail learned);
- ``ids_and_category``: both at once: what remains when the data is too thin for either.

    gemctl data learnability recipes/demo.yaml [--set data.synthetic.x=v] [--json]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from gem_platform.data.arrays import SampleArrays
from gem_platform.data.ceilings import CATEGORY_LEVEL, PLANTED, auc
from gem_platform.data.config import SyntheticConfig
from gem_platform.data.synthetic import SPARSE_EFFECT_STD, PlantedWorld, shard_rng

TASKS = ("ctr", "cvr")


@dataclass
class IdInformation:
    """What the training split tells about each id: samples that carry it and the Fisher
    information on its planted effect, per task."""

    samples: dict[str, np.ndarray] = field(default_factory=dict)  # feature -> (vocab,)
    info: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # task -> feature -> ..
    ad_items: np.ndarray | None = None  # (num_items+1,) training impressions per item
    history_items: np.ndarray | None = None  # (num_items+1,) training history events per item

    def add(self, name: str, ids: np.ndarray, size: int, weights: dict[str, np.ndarray]) -> None:
        """Count one shard's occurrences of a feature's ids, ``weights[task]`` per occurrence."""
        count = np.bincount(ids, minlength=size)
        self.samples[name] = self.samples.get(name, 0) + count
        for task, w in weights.items():
            per = self.info.setdefault(task, {})
            per[name] = per.get(name, 0) + np.bincount(ids, weights=w, minlength=size)


def _occurrences(arrays: SampleArrays, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sparse feature's ids, the sample of each, and each id's weight in the logit."""
    off = arrays.sparse_offsets[name]
    lengths = np.diff(off)
    owner = np.repeat(np.arange(len(arrays)), lengths)
    return arrays.sparse_values[name], owner, 1.0 / np.maximum(lengths, 1)[owner]


def training_information(world: PlantedWorld) -> IdInformation:
    """Per-id sample counts and information over the training split, shard by shard."""
    syn = world.cfg
    out = IdInformation(ad_items=np.zeros(syn.num_items + 1, np.int64),
                        history_items=np.zeros(syn.num_items + 1, np.int64))
    for i, start in enumerate(range(0, syn.num_train, syn.rows_per_shard)):
        rng = shard_rng(syn.seed, "train", i)
        arrays = world.sample(rng, min(syn.rows_per_shard, syn.num_train - start))
        p_ctr, p_cvr = world.label(rng, arrays)
        clicked = arrays.ctr.astype(np.float64)
        fisher = {"ctr": p_ctr * (1 - p_ctr), "cvr": clicked * p_cvr * (1 - p_cvr)}
        for spec in world.sparse_specs:
            ids, owner, w = _occurrences(arrays, spec.name)
            out.add(spec.name, ids, spec.vocab_size,
                    {task: w**2 * f[owner] for task, f in fisher.items()})
        out.ad_items += np.bincount(arrays.ad_item_id, minlength=syn.num_items + 1)
        out.history_items += np.bincount(arrays.seq_item_ids, minlength=syn.num_items + 1)
    return out


def learnable_effects(effects: np.ndarray, info: np.ndarray, rng: np.random.Generator
                      ) -> np.ndarray:
    """Per id, the posterior mean an ideal learner would reach: the planted effect seen
    through Gaussian noise of variance 1/info, shrunk toward the prior's mean 0."""
    precision = SPARSE_EFFECT_STD**-2 + info
    noise = np.sqrt(info) * rng.standard_normal(effects.size)
    return (info * effects + noise) / precision


def learnable_world(world: PlantedWorld, ids: IdInformation, seed: int) -> PlantedWorld:
    """The world with every per-id effect at its learnable estimate."""
    rng = np.random.default_rng(seed)
    ctr = {n: learnable_effects(e, ids.info["ctr"][n], rng) for n, e in world.ctr_effects.items()}
    cvr = {n: learnable_effects(e, ids.info["cvr"][n], rng) for n, e in world.cvr_effects.items()}
    return replace(world, ctr_effects=ctr, cvr_effects=cvr)


def eval_split(world: PlantedWorld, max_rows: int | None = None) -> list[SampleArrays]:
    """The eval split's shards, labelled, as the generator writes them; with ``max_rows``
    only its first shards, as many as hold that many rows."""
    syn = world.cfg
    rows = syn.num_eval if max_rows is None else min(max_rows, syn.num_eval)
    parts = []
    for i, start in enumerate(range(0, rows, syn.rows_per_shard)):
        rng = shard_rng(syn.seed, "eval", i)
        arrays = world.sample(rng, min(syn.rows_per_shard, syn.num_eval - start))
        world.label(rng, arrays)
        parts.append(arrays)
    return parts


def ceilings(world: PlantedWorld, ids: IdInformation, parts: Sequence[SampleArrays]
             ) -> dict[str, dict[str, float]]:
    """Per task, the AUC on the eval split (``parts``) of the planted scorer, as learnable per
    id, at category level, and both."""
    learnable = learnable_world(world, ids, world.cfg.seed)
    scorers = {PLANTED: world, "ids_as_learnable": learnable,
               CATEGORY_LEVEL: world.category_level(),
               "ids_and_category": learnable.category_level()}
    ctr = np.concatenate([a.ctr for a in parts])
    cvr = np.concatenate([a.cvr for a in parts])
    clicked = ctr == 1
    out: dict[str, dict[str, float]] = {task: {} for task in TASKS}
    for name, scorer in scorers.items():
        z = [scorer.raw_logits(a) for a in parts]
        z_ctr = np.concatenate([zc for zc, _ in z])
        z_cvr = np.concatenate([zv for _, zv in z])
        out["ctr"][name] = auc(z_ctr, ctr)
        out["cvr"][name] = auc(z_cvr[clicked], cvr[clicked])
    return out


def seen_in_training(train_count: np.ndarray, eval_ids: np.ndarray) -> dict[str, float]:
    """How often the ids of eval samples occur in training: per id on average, and over the
    eval occurrences (what the model has seen of the id it meets) the median, the 10th
    percentile and the share never seen."""
    seen = train_count[eval_ids]
    return {"mean_per_id": float(train_count.mean()),
            "median_seen": float(np.median(seen)) if seen.size else 0.0,
            "p10_seen": float(np.percentile(seen, 10)) if seen.size else 0.0,
            "unseen": float((seen == 0).mean()) if seen.size else 0.0}


def report(syn: SyntheticConfig) -> dict:
    """Samples per id and the ceilings of one synthetic config."""
    world = PlantedWorld.build(syn)
    ids = training_information(world)
    parts = eval_split(world)
    joined = SampleArrays.concat(parts)
    per_id = {spec.name: seen_in_training(ids.samples[spec.name],
                                          joined.sparse_values[spec.name])
              for spec in world.sparse_specs}
    per_id["ad_item"] = seen_in_training(ids.ad_items[1:], joined.ad_item_id - 1)
    per_id["ad_item_in_histories"] = seen_in_training(ids.history_items[1:],
                                                      joined.ad_item_id - 1)
    return {"num_train": syn.num_train, "num_users": syn.num_users, "num_items": syn.num_items,
            "samples_per_id": per_id, "auc": ceilings(world, ids, parts)}
