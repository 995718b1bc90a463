"""Synthetic GEM-style data whose labels come from a planted ground truth.

The world: items live in ``num_clusters`` clusters of a latent space (unit vectors near their
cluster's centroid); an item's cluster is its category, written beside every history event and
the candidate (``seq_item_categories``, ``ad_category``), as a catalog would. Each user has a
few long-term interest clusters and one recent interest that is absent from their older
history. A sample is (user, jagged history, context features, dense features, candidate ad);
its click probability comes from a planted scorer that reads

- the candidate's affinity to the last ``RECENT_WINDOW`` events of the history,
- separately, its affinity to the older events (long-term interests),
- both weighted by action type (a purchase says more than a view); affinity is the cosine of
  the two items' latent vectors: mostly how related their categories are, plus item-level
  detail (each item's offset from its category centroid) that categories alone can't tell,
- per-id effects of every sparse feature (user bias, context, tags) and of the ad category,
- a linear plus one pairwise term of the dense features;

the conversion probability (among clicks) reads past high-intent actions on similar items,
recent affinity and its own sparse/dense effects. Labels are Bernoulli draws, so the planted
scorer's AUC on the eval split (``meta.planted_auc``) is the ceiling any model can reach, and
a model that ignores (or mis-attends) the history stays well below it.

Histories are drawn independently per sample (two samples of one user don't share a prefix).
Everything is drawn from numpy generators seeded from ``(seed, split, shard)``, so the same
config writes byte-identical shards whichever process draws them: a large dataset's shards
are drawn by a pool of processes (one shard at a time each, so memory stays bounded by the
pool's size), a small one's in this process. The pool's processes are spawned, so a script of
one's own that generates a large dataset needs the ``if __name__ == "__main__":`` guard
around its work, as for any spawned worker (gemctl, pytest and Ray workers have it).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from gem_platform.data.arrays import SampleArrays
from gem_platform.data.budget import check_affordable, synthetic_cost
from gem_platform.data.ceilings import (
    CATEGORY_LEVEL,
    PLANTED,
    WITHOUT_WORLD_TERM,
    ZONE_BAGS,
    auc,
    ceiling_aucs,
)
from gem_platform.data.config import RECENT_WINDOW, DataConfig, SeqLenConfig, SyntheticConfig
from gem_platform.data.meta import META_FILE, DatasetMeta, SparseFeatureSpec, is_count
from gem_platform.data.ownership import Writer, check_replaceable
from gem_platform.data.shards import load_meta, shard_name, write_shard
from gem_platform.data.source import SPLITS
from gem_platform.data.staging import os_errors, remove_stale_staging, staged_dataset
from gem_platform.data.worlds import (
    W_LONG_RANGE,
    W_LOOKBACK,
    W_RECALL,
    Interests,
    lookback_balance,
    mean_per_sample,
    recall_history,
    recall_sign,
    returning_share,
    zone_bag_overlap,
    zone_lookback_balance,
    zoned_history,
    zoned_interests,
)
from gem_platform.file_lock import exclusive_lock

log = logging.getLogger(__name__)

GENERATOR_VERSION = 3  # part of the reuse hash: bump whenever the generated data changes
LATENT_DIM = 16
ITEM_NOISE = 0.15  # spread of item vectors around their cluster centroid (per dimension)
LONG_TERM_INTERESTS = 3
# Worlds with a CTR term of their own, named after the world, that only attention across
# 64-token blocks reads.
WORLD_TERMS = ("long_range", "lookback", "recall")
# Of those, the worlds whose term a model can partly recover by pooling zones of the history
# apart and comparing them (ceilings: zone_bags).
ZONE_BAG_TERMS = ("long_range", "lookback")
PILOT_SAMPLES = 8192  # samples drawn to calibrate the label base rates (~0.002 error)
# Above this many history events a dataset's shards are drawn by a pool of processes.
PARALLEL_TOKENS = 20_000_000
MIN_POOL_CORES = 4

# Planted logit weights: the history terms dominate so attention quality matters.
W_RECENT = 4.0
W_LONG = 4.0
W_CVR_INTENT = 2.5
W_CVR_RECENT = 1.0
SPARSE_EFFECT_STD = 0.25
DENSE_WEIGHT_STD = 0.15
DENSE_PAIR_WEIGHT = 0.3


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=key))


def shard_rng(seed: int, split: str, shard: int) -> np.random.Generator:
    """The generator of one shard of a split (``train`` or ``eval``): what it draws is what
    ``generate_synthetic`` writes to that shard."""
    return _rng(seed, 2 + SPLITS.index(split), shard)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def draw_lengths(rng: np.random.Generator, cfg: SeqLenConfig, n: int) -> np.ndarray:
    """History lengths from the configured long-tailed distribution, clipped to [min, max]."""
    if cfg.dist == "lognormal":
        mu = np.log(cfg.mean) - cfg.sigma**2 / 2.0
        raw = np.exp(mu + cfg.sigma * rng.standard_normal(n))
    elif cfg.dist == "powerlaw":
        xm = cfg.mean * (cfg.alpha - 1.0) / cfg.alpha
        raw = xm * (1.0 + rng.pareto(cfg.alpha, n))
    else:
        raw = np.full(n, cfg.mean)
    return np.clip(np.rint(raw), cfg.min, cfg.max).astype(np.int64)


def _segment_mean(values: np.ndarray, owner: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    return mean_per_sample(owner[mask], values[mask], n)


def _skewed_ids(rng: np.random.Generator, size: np.ndarray | int, n: int) -> np.ndarray:
    """Ids in [0, size) with a popularity skew (low ids are popular)."""
    return np.minimum(
        (np.asarray(size) * rng.random(n) ** 2).astype(np.int64), np.asarray(size) - 1
    )


def sparse_specs(cfg: SyntheticConfig) -> list[SparseFeatureSpec]:
    """The dataset's sparse features: the built-in user id, then the configured ones."""
    return [
        SparseFeatureSpec("user_id", cfg.num_users),
        *(SparseFeatureSpec(f.name, f.vocab_size, f.multi_hot) for f in cfg.sparse_features),
    ]


@dataclass(frozen=True)
class PlantedTerms:
    """Per task, the planted logit's terms in the order they are summed (name -> (n,)).
    ``dense`` and ``dense_pair`` (CTR) are the linear and the pairwise dense terms."""

    ctr: dict[str, np.ndarray]
    cvr: dict[str, np.ndarray]

    def task(self, name: str) -> dict[str, np.ndarray]:
        return self.ctr if name == "ctr" else self.cvr


def _total(terms: dict[str, np.ndarray]) -> np.ndarray:
    """The terms summed left to right (the order fixes the float result, so the data)."""
    parts = iter(terms.values())
    total = next(parts)
    for part in parts:
        total = total + part
    return total


@dataclass
class PlantedWorld:
    """The latent structure and the planted scorer; fully determined by the config's seed."""

    cfg: SyntheticConfig
    item_cluster: np.ndarray  # (num_items+1,), entry 0 unused: the item's category
    item_vec: np.ndarray  # (num_items+1, LATENT_DIM) float32, row 0 zero
    cluster_items: np.ndarray  # item ids sorted by cluster
    cluster_start: np.ndarray  # (K,)
    cluster_size: np.ndarray  # (K,)
    user_interests: np.ndarray  # (U, LONG_TERM_INTERESTS) clusters
    user_interest_cdf: np.ndarray  # (U, LONG_TERM_INTERESTS)
    user_recent: np.ndarray  # (U,) cluster of the recent interest
    user_gap_seconds: np.ndarray  # (U,) mean seconds between a user's events
    action_probs: np.ndarray  # (A,)
    action_weight: np.ndarray  # (A,)
    ctr_effects: dict[str, np.ndarray]  # sparse feature -> per-id logit effect
    cvr_effects: dict[str, np.ndarray]
    category_ctr: np.ndarray  # (K,) logit effect of the candidate's category
    category_cvr: np.ndarray
    dense_w_ctr: np.ndarray
    dense_w_cvr: np.ndarray
    ctr_bias: float = 0.0
    cvr_bias: float = 0.0

    @property
    def sparse_specs(self) -> list[SparseFeatureSpec]:
        return sparse_specs(self.cfg)

    @classmethod
    def build(cls, cfg: SyntheticConfig) -> PlantedWorld:
        rng = _rng(cfg.seed, 0)
        k, u, a = cfg.num_clusters, cfg.num_users, cfg.num_action_types
        item_cluster = np.concatenate([[0], rng.integers(0, k, cfg.num_items)])
        item_cluster[1 : k + 1] = np.arange(k)  # every cluster holds at least one item
        centroids = rng.standard_normal((k, LATENT_DIM))
        centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
        vec = centroids[item_cluster] + ITEM_NOISE * rng.standard_normal(
            (cfg.num_items + 1, LATENT_DIM)
        )
        vec /= np.linalg.norm(vec, axis=1, keepdims=True)
        vec[0] = 0.0
        order = np.argsort(item_cluster[1:], kind="stable") + 1
        size = np.bincount(item_cluster[1:], minlength=k)
        start = np.concatenate([[0], np.cumsum(size)[:-1]])
        interests = rng.integers(0, k, (u, LONG_TERM_INTERESTS))
        weights = rng.dirichlet(np.ones(LONG_TERM_INTERESTS), u)
        recent = rng.integers(0, k, u)
        gap = np.exp(rng.normal(np.log(6 * 3600.0), 1.0, u))
        action_probs = 0.5 ** np.arange(a)
        action_probs /= action_probs.sum()
        action_weight = np.linspace(0.5, 2.0, a) if a > 1 else np.ones(1)
        specs = sparse_specs(cfg)
        ctr_eff = {s.name: SPARSE_EFFECT_STD * rng.standard_normal(s.vocab_size) for s in specs}
        cvr_eff = {s.name: SPARSE_EFFECT_STD * rng.standard_normal(s.vocab_size) for s in specs}
        world = cls(
            cfg=cfg,
            item_cluster=item_cluster,
            item_vec=vec.astype(np.float32),
            cluster_items=order,
            cluster_start=start,
            cluster_size=size,
            user_interests=interests,
            user_interest_cdf=np.cumsum(weights, axis=1),
            user_recent=recent,
            user_gap_seconds=gap,
            action_probs=action_probs,
            action_weight=action_weight,
            ctr_effects=ctr_eff,
            cvr_effects=cvr_eff,
            category_ctr=SPARSE_EFFECT_STD * rng.standard_normal(k),
            category_cvr=SPARSE_EFFECT_STD * rng.standard_normal(k),
            dense_w_ctr=DENSE_WEIGHT_STD * rng.standard_normal(cfg.dense_dim),
            dense_w_cvr=DENSE_WEIGHT_STD * rng.standard_normal(cfg.dense_dim),
        )
        world._calibrate(_rng(cfg.seed, 1))
        return world

    # -- sampling -------------------------------------------------------------------------

    def _items_of(self, rng: np.random.Generator, clusters: np.ndarray) -> np.ndarray:
        size = self.cluster_size[clusters]
        return self.cluster_items[self.cluster_start[clusters] + _skewed_ids(rng, size, len(size))]

    def _user_interests(self, users: np.ndarray) -> Interests:
        """Standard world: each sample follows its user's interests."""
        return Interests(self.user_interests[users], self.user_interest_cdf[users],
                          self.user_recent[users])

    def _standard_history(self, rng: np.random.Generator, interests: Interests,
                          owner: np.ndarray, from_end: np.ndarray) -> np.ndarray:
        """Clusters of the history events: recent events mostly follow the recent interest,
        older ones the long-term interests."""
        t = owner.size
        r = rng.random(t)
        recent = from_end < RECENT_WINDOW
        clusters = interests.pick(rng, owner)
        clusters = np.where(recent & (r < 0.7), interests.recent[owner], clusters)
        noise = np.where(recent, r >= 0.9, r >= 0.8)
        return np.where(noise, rng.integers(0, self.cfg.num_clusters, t), clusters)

    def sample(self, rng: np.random.Generator, n: int) -> SampleArrays:
        """``n`` unlabeled samples (labels are zero until :meth:`label`)."""
        c = self.cfg
        users = rng.integers(0, c.num_users, n)
        lengths = draw_lengths(rng, c.seq_len, n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        t = int(offsets[-1])
        owner = np.repeat(np.arange(n), lengths)
        from_end = offsets[owner + 1] - 1 - np.arange(t)
        ev_user = users[owner]

        interests: Interests | None = None
        if c.world == "standard":
            interests = self._user_interests(users)
            clusters = self._standard_history(rng, interests, owner, from_end)
        elif c.world == "lookback":  # independent events, alike at every position
            clusters = rng.integers(0, c.num_clusters, t)
        elif c.world == "recall":  # independent events but the newest
            clusters = recall_history(rng, offsets, c.num_clusters)
        else:
            interests = zoned_interests(rng, n, c.num_clusters, LONG_TERM_INTERESTS)
            clusters = zoned_history(rng, interests, owner, from_end, c.num_clusters)
        items = self._items_of(rng, clusters)
        actions = rng.choice(c.num_action_types, size=t, p=self.action_probs)
        gaps = rng.exponential(1.0, t) * self.user_gap_seconds[ev_user]
        csum = np.cumsum(gaps)
        ends = csum[np.maximum(offsets[owner + 1] - 1, 0)] if t else csum
        age = ends - csum + gaps  # seconds from the event to the request
        seq_age = np.log1p(age).astype(np.float32)

        if interests is None:  # worlds lookback, recall: no interests, any candidate
            ad_cluster = rng.integers(0, c.num_clusters, n)
        else:
            r_ad = rng.random(n)
            ad_cluster = np.where(r_ad < 0.35, interests.recent,
                                  interests.pick(rng, np.arange(n)))
            ad_cluster = np.where(r_ad >= 0.7, rng.integers(0, c.num_clusters, n), ad_cluster)
        ad = self._items_of(rng, ad_cluster)

        values = {"user_id": users}
        offs = {"user_id": np.arange(n + 1)}
        for f in c.sparse_features:
            if f.multi_hot:
                cnt = rng.integers(1, f.max_ids + 1, n)
                off = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(cnt, out=off[1:])
                values[f.name] = _skewed_ids(rng, f.vocab_size, int(off[-1]))
                offs[f.name] = off
            else:
                values[f.name] = _skewed_ids(rng, f.vocab_size, n)
                offs[f.name] = np.arange(n + 1)
        dense = rng.standard_normal((n, c.dense_dim)).astype(np.float32)
        return SampleArrays(
            seq_offsets=offsets,
            seq_item_ids=items.astype(np.int64),
            seq_action_types=actions.astype(np.int64),
            seq_age=seq_age,
            ad_item_id=ad.astype(np.int64),
            sparse_values={k: v.astype(np.int64) for k, v in values.items()},
            sparse_offsets={k: v.astype(np.int64) for k, v in offs.items()},
            dense=dense,
            ctr=np.zeros(n, np.int8),
            cvr=np.zeros(n, np.int8),
            seq_item_categories=self.item_cluster[items].astype(np.int64),
            ad_category=self.item_cluster[ad].astype(np.int64),
        )

    # -- the planted scorer ---------------------------------------------------------------

    def _sparse_term(self, arrays: SampleArrays, effects: dict[str, np.ndarray]) -> np.ndarray:
        n = len(arrays)
        out = np.zeros(n)
        for name, eff in effects.items():
            off = arrays.sparse_offsets[name]
            lengths = np.diff(off)
            owner = np.repeat(np.arange(n), lengths)
            out += np.bincount(owner, weights=eff[arrays.sparse_values[name]], minlength=n) / (
                np.maximum(lengths, 1)
            )
        return out

    def terms(self, arrays: SampleArrays) -> PlantedTerms:
        """The planted logits of every sample, term by term (before the calibrated biases)."""
        n = len(arrays)
        lengths = arrays.seq_lengths
        owner = np.repeat(np.arange(n), lengths)
        from_end = arrays.seq_offsets[owner + 1] - 1 - np.arange(len(owner))
        recent = from_end < RECENT_WINDOW
        cand = self.item_vec[arrays.ad_item_id]
        sim = np.einsum("td,td->t", self.item_vec[arrays.seq_item_ids], cand[owner])
        weighted = sim * self.action_weight[arrays.seq_action_types]
        aff_recent = _segment_mean(weighted, owner, recent, n)
        intent = arrays.seq_action_types == self.cfg.num_action_types - 1
        # no history signal beyond the recent one
        local = self.cfg.world in ("local", "lookback", "recall")
        aff_intent = _segment_mean(sim, owner, intent & recent if local else intent, n)

        ad_cluster = self.item_cluster[arrays.ad_item_id]
        d = arrays.dense.astype(np.float64)
        pair = d[:, 0] * d[:, 1] if d.shape[1] >= 2 else np.zeros(n)
        ctr = {"recent_affinity": W_RECENT * aff_recent}
        if not local:
            ctr["long_affinity"] = W_LONG * _segment_mean(weighted, owner, ~recent, n)
        ctr |= {
            "sparse_ids": self._sparse_term(arrays, self.ctr_effects),
            "ad_category": self.category_ctr[ad_cluster],
            "dense": d @ self.dense_w_ctr,
            "dense_pair": DENSE_PAIR_WEIGHT * pair,
        }
        if self.cfg.world == "long_range":
            categories = self.item_cluster[arrays.seq_item_ids]
            ctr["long_range"] = W_LONG_RANGE * returning_share(arrays.seq_offsets, categories)
        if self.cfg.world == "lookback":
            categories = self.item_cluster[arrays.seq_item_ids]
            ctr["lookback"] = W_LOOKBACK * lookback_balance(arrays.seq_offsets, categories, intent)
        if self.cfg.world == "recall":
            categories = self.item_cluster[arrays.seq_item_ids]
            ctr["recall"] = W_RECALL * recall_sign(arrays.seq_offsets, categories)
        cvr = {
            "intent_affinity": W_CVR_INTENT * aff_intent,
            "recent_affinity": W_CVR_RECENT * aff_recent,
            "sparse_ids": self._sparse_term(arrays, self.cvr_effects),
            "ad_category": self.category_cvr[ad_cluster],
            "dense": d @ self.dense_w_cvr,
        }
        return PlantedTerms(ctr, cvr)

    def raw_logits(self, arrays: SampleArrays) -> tuple[np.ndarray, np.ndarray]:
        """CTR and CVR logits before the calibrated biases."""
        terms = self.terms(arrays)
        return _total(terms.ctr), _total(terms.cvr)

    def category_level(self) -> PlantedWorld:
        """This world with every item vector replaced by its category's centroid: the scorer
        that knows items only by their category (affinities at category level)."""
        k = self.cfg.num_clusters
        centroid = np.zeros((k, self.item_vec.shape[1]))
        np.add.at(centroid, self.item_cluster[1:], self.item_vec[1:])
        centroid /= np.maximum(np.bincount(self.item_cluster[1:], minlength=k), 1)[:, None]
        vec = centroid[self.item_cluster].astype(np.float32)
        vec[0] = 0.0
        return replace(self, item_vec=vec)

    def ceiling_scores(self, arrays: SampleArrays) -> dict[str, dict[str, np.ndarray]]:
        """Per task: each planted term alone (the two dense terms as one), the whole planted
        logit and the planted logit at category level; gem_platform.data.ceilings turns them
        into AUCs."""
        full, coarse = self.terms(arrays), self.category_level().terms(arrays)
        out: dict[str, dict[str, np.ndarray]] = {}
        for task in ("ctr", "cvr"):
            alone = dict(full.task(task))
            if "dense_pair" in alone:
                alone["dense"] = alone["dense"] + alone.pop("dense_pair")
            out[task] = {**alone, PLANTED: _total(full.task(task)),
                         CATEGORY_LEVEL: _total(coarse.task(task))}
        term = self.cfg.world
        if term in WORLD_TERMS:
            rest = {k: v for k, v in full.ctr.items() if k != term}
            out["ctr"][WITHOUT_WORLD_TERM] = _total(rest)
            if term in ZONE_BAG_TERMS:
                out["ctr"][ZONE_BAGS] = self._through_zone_bags(arrays, full.ctr, term)
        return out

    def _through_zone_bags(self, arrays: SampleArrays, ctr: dict[str, np.ndarray], term: str
                           ) -> np.ndarray:
        """The CTR logit with the world's own term replaced by the term's least-squares fit
        from what the zones' bags tell of it (worlds.zone_bag_overlap, zone_lookback_balance)."""
        categories = self.item_cluster[arrays.seq_item_ids]
        if term == "long_range":
            overlap = zone_bag_overlap(arrays.seq_offsets, categories)
        else:
            intent = arrays.seq_action_types == self.cfg.num_action_types - 1
            overlap = zone_lookback_balance(arrays.seq_offsets, categories, intent)
        if np.ptp(overlap) == 0:  # nothing to fit from: the term's mean
            return _total({**ctr, term: np.full_like(overlap, ctr[term].mean())})
        fitted = np.polyval(np.polyfit(overlap, ctr[term], 1), overlap)
        return _total({**ctr, term: fitted})

    def probabilities(self, arrays: SampleArrays) -> tuple[np.ndarray, np.ndarray]:
        """Planted P(click) and P(conversion | click) of every sample."""
        z_ctr, z_cvr = self.raw_logits(arrays)
        return sigmoid(z_ctr + self.ctr_bias), sigmoid(z_cvr + self.cvr_bias)

    def label(
        self, rng: np.random.Generator, arrays: SampleArrays
    ) -> tuple[np.ndarray, np.ndarray]:
        """Draw the labels in place: click ~ Bernoulli(p_ctr), conversion only if clicked.

        Returns the planted probabilities the labels were drawn from.
        """
        p_ctr, p_cvr = self.probabilities(arrays)
        ctr = rng.random(len(arrays)) < p_ctr
        cvr = ctr & (rng.random(len(arrays)) < p_cvr)
        arrays.ctr[:] = ctr
        arrays.cvr[:] = cvr
        return p_ctr, p_cvr

    def _calibrate(self, rng: np.random.Generator) -> None:
        """Pick the two biases so the expected label rates equal the configured base rates."""
        pilot = self.sample(rng, PILOT_SAMPLES)
        z_ctr, z_cvr = self.raw_logits(pilot)
        self.ctr_bias = _solve_bias(z_ctr, self.cfg.ctr_base_rate, None)
        self.cvr_bias = _solve_bias(z_cvr, self.cfg.cvr_base_rate, sigmoid(z_ctr + self.ctr_bias))


def _solve_bias(z: np.ndarray, rate: float, weights: np.ndarray | None) -> float:
    """b with weighted mean(sigmoid(z + b)) == rate (bisection; the mean is monotone in b)."""
    lo, hi = -40.0, 40.0
    for _ in range(80):
        mid = (lo + hi) / 2.0
        if np.average(sigmoid(z + mid), weights=weights) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


# ----------------------------------------------------------------------------- on disk


def _fingerprint(syn: SyntheticConfig) -> str:
    return f"v{GENERATOR_VERSION}-{syn.fingerprint()}"


def _not_generated(meta: DatasetMeta) -> str | None:
    """Why ``meta`` is not one this generator wrote (any version), or None when it is."""
    if meta.source != "synthetic":
        return f"its meta.json says source {meta.source!r}"
    version, digest = meta.extra.get("generator_version"), meta.extra.get("config_hash")
    if not (is_count(version) and isinstance(digest, str)
            and re.fullmatch(rf"v{version}-[0-9a-f]{{16}}", digest)):
        return "its meta.json lacks the generator's fingerprint (config_hash, generator_version)"
    return None


SYNTHETIC = Writer("the synthetic generator", _not_generated)


def _is_current(directory: Path, fingerprint: str) -> bool:
    if not (directory / META_FILE).is_file():
        return False
    try:
        meta = DatasetMeta.load(directory)
    except Exception:  # a corrupt meta.json just means "regenerate"
        return False
    if meta.extra.get("config_hash") != fingerprint:
        return False
    shards = meta.extra.get("shards", {})
    return all(
        (directory / shard_name(split, i)).is_file()
        for split in SPLITS
        for i in range(int(shards.get(split, 0)))
    ) and bool(shards)


@dataclass(frozen=True)
class ShardTask:
    """One shard to draw and write: its split, its index there and its rows."""

    directory: Path
    split: str
    index: int
    rows: int


@dataclass
class ShardResult:
    """What the meta needs from one written shard (the eval split's labels and scores)."""

    task: ShardTask
    clicks: int
    convs: int
    lengths: np.ndarray  # (rows,) history lengths
    eval_p: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    eval_scores: dict[str, dict[str, np.ndarray]] | None = None


def _draw_shard(world: PlantedWorld, task: ShardTask) -> ShardResult:
    """Draw, label and write one shard from its own seeded generator."""
    rng = _rng(world.cfg.seed, 2 + SPLITS.index(task.split), task.index)
    arrays = world.sample(rng, task.rows)
    p_ctr, p_cvr = world.label(rng, arrays)
    write_shard(task.directory / shard_name(task.split, task.index), arrays, world.sparse_specs)
    result = ShardResult(task, int(arrays.ctr.sum()), int(arrays.cvr.sum()),
                         arrays.seq_lengths.copy())
    if task.split == "eval":
        result.eval_p = (p_ctr, p_cvr, arrays.ctr, arrays.cvr)
        result.eval_scores = world.ceiling_scores(arrays)
    return result


_POOL_WORLD: PlantedWorld | None = None  # each pool process's own copy of the world


def _build_pool_world(syn: SyntheticConfig) -> None:
    global _POOL_WORLD
    _POOL_WORLD = PlantedWorld.build(syn)


def _draw_in_pool(task: ShardTask) -> ShardResult:
    assert _POOL_WORLD is not None, "the pool's initializer builds the world"
    return _draw_shard(_POOL_WORLD, task)


def usable_cores() -> int:
    """Cores this process may run on (its affinity, where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def generation_processes(syn: SyntheticConfig, shards: int, cores: int | None = None) -> int:
    """Processes that draw the shards: one per core (``cores``, default usable_cores()), at
    most one per shard, for a dataset of more than PARALLEL_TOKENS history events on a
    machine of at least MIN_POOL_CORES cores; else 1 (this process: each pool process pays
    its start-up and its own copy of the world, which a few cores do not win back)."""
    cores = cores or usable_cores()
    if cores < MIN_POOL_CORES or syn.num_samples * _mean_history(syn) <= PARALLEL_TOKENS:
        return 1
    return max(1, min(cores, shards))


def _draw_all(syn: SyntheticConfig, tasks: list[ShardTask], processes: int
              ) -> list[ShardResult]:
    """Every task's result, in the tasks' order. The world is built where the shards are
    drawn: here, or once in each pool process, spawned (not forked: the caller may be a
    training process with threads), from its config, which is cheaper than sending it."""
    if processes <= 1:
        world = PlantedWorld.build(syn)
        return [_draw_shard(world, t) for t in tasks]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=context, initializer=_build_pool_world,
                             initargs=(syn,)) as pool:
        return list(pool.map(_draw_in_pool, tasks))


def _write_dataset(directory: Path, syn: SyntheticConfig, fingerprint: str,
                   processes: int | None = None) -> DatasetMeta:
    """Write every shard and the meta; ``processes`` None picks generation_processes."""
    sizes = {"train": syn.num_train, "eval": syn.num_eval}
    tasks = [ShardTask(directory, split, i, min(syn.rows_per_shard, sizes[split] - start))
             for split in SPLITS for i, start in enumerate(range(0, sizes[split],
                                                                 syn.rows_per_shard))]
    if processes is None:
        processes = generation_processes(syn, len(tasks))
    results = _draw_all(syn, tasks, processes)
    shards = {split: sum(r.task.split == split for r in results) for split in SPLITS}
    rates = {split: [sum(r.clicks for r in results if r.task.split == split),
                     sum(r.convs for r in results if r.task.split == split)]
             for split in SPLITS}
    all_lengths = [r.lengths for r in results]
    max_len = max((int(x.max(initial=0)) for x in all_lengths), default=0)
    total_len = sum(int(x.sum()) for x in all_lengths)
    train_lengths = np.zeros(syn.seq_len.max + 1, dtype=np.int64)
    for r in results:
        if r.task.split == "train":
            train_lengths += np.bincount(r.lengths, minlength=train_lengths.size)
    evals = [r for r in results if r.task.split == "eval"]
    eval_scores = [r.eval_scores for r in evals]
    p_ctr, p_cvr, ctr, cvr = (np.concatenate(x) for x in zip(*(r.eval_p for r in evals),
                                                             strict=True))
    clicked = ctr == 1
    train_clicks, train_convs = rates["train"]
    meta = DatasetMeta(
        source="synthetic",
        num_items=syn.num_items,
        num_action_types=syn.num_action_types,
        sparse_features=sparse_specs(syn),
        dense_dim=syn.dense_dim,
        num_train=syn.num_train,
        num_eval=syn.num_eval,
        ctr_base_rate=train_clicks / syn.num_train,
        cvr_base_rate=train_convs / max(train_clicks, 1),
        planted_auc={"ctr": auc(p_ctr, ctr), "cvr": auc(p_cvr[clicked], cvr[clicked])},
        max_seq_len=max_len,
        num_categories=syn.num_clusters,
        extra={
            "config_hash": fingerprint,
            "generator_version": GENERATOR_VERSION,
            "seed": syn.seed,
            "shards": shards,
            "configured_ctr_base_rate": syn.ctr_base_rate,
            "configured_cvr_base_rate": syn.cvr_base_rate,
            "eval_ctr_rate": float(ctr.mean()),
            "eval_cvr_rate": float(cvr[clicked].mean()) if clicked.any() else 0.0,
            "mean_seq_len": total_len / syn.num_samples,
            "num_users": syn.num_users,
            "num_clusters": syn.num_clusters,
            "recent_window": RECENT_WINDOW,
            "world": syn.world,
            # AUC of each planted term alone and of the scorer at category level
            **ceiling_aucs(eval_scores, ctr, cvr),
            # train samples per history length: every rank's expected work per batch
            "seq_len_histogram": np.trim_zeros(train_lengths, "b").tolist(),
        },
    )
    meta.save(directory)
    return meta


@contextmanager
def _generation_lock(out: Path) -> Iterator[None]:
    """Serialize generators of one directory (e.g. every worker of a run on one host)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(out.parent / f".{out.name}.lock"):
        yield


def _mean_history(syn: SyntheticConfig) -> float:
    """Mean history length of the configured distribution (from a fixed-seed draw)."""
    return float(draw_lengths(_rng(syn.seed, 99), syn.seq_len, 4096).mean())


def generate_synthetic(cfg: DataConfig, *, force: bool = False) -> DatasetMeta:
    """Make sure ``cfg.path`` holds the dataset of ``cfg.synthetic`` and return its meta.

    A directory already generated from the same config (hash in ``meta.extra``) is reused
    unless ``force``. Otherwise, only where the folder is new, empty or this generator's own
    (ownership.py) and the dataset fits on disk and in memory (budget.py), it is written to a
    staging folder and renamed into place, so a crash never leaves half-written shards behind.
    Concurrent calls on one host wait for each other, and the later ones reuse what the first
    wrote. Staging folders beside it that a killed writer left are removed first (staging.py).
    Anything the system refuses (read-only folder, name too long) is a DataError.
    """
    syn = cfg.synthetic
    out = Path(cfg.path)
    fingerprint = _fingerprint(syn)
    with os_errors("data.path", out):
        remove_stale_staging(out)  # a killed writer's leftovers, even when nothing is written
        if not force and _is_current(out, fingerprint):
            return load_meta(out)
        check_replaceable(out, "data.path", SYNTHETIC)
        check_affordable(out, synthetic_cost(syn, _mean_history(syn)))
        started = time.monotonic()
        with _generation_lock(out):
            if force or not _is_current(out, fingerprint):
                with staged_dataset(out, "data.path", SYNTHETIC) as tmp:
                    _write_dataset(tmp, syn, fingerprint)
                log.info("generated %s in %.1f s", out, time.monotonic() - started)
        return load_meta(out)
