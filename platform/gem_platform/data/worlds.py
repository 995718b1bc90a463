"""The planted worlds with a known answer for attention ablations (``data.synthetic.world``).

``standard`` is the world of gem_platform.data.synthetic. ``long_range`` and ``local`` share
one way of drawing histories, in three zones counted from the newest event:

- recent (the last ``RECENT_WINDOW`` events): mostly the sample's recent interest;
- middle (up to ``LONG_RANGE_GAP`` events back): the sample's session interests, drawn apart
  from its long-term ones, so nothing near the end of a history tells what lies further back;
- old (``LONG_RANGE_GAP`` or more events back): the sample's long-term interests.

Half the samples have a *returning* recent interest (one of their long-term interests, so its
category shows up again after a gap); the others a fresh one. Interests are drawn per sample,
not per user, so a model cannot learn them from the user id instead of reading the history.

- ``long_range``: the CTR logit gains ``W_LONG_RANGE`` times the share of recent events whose
  category also occurs among the old events (:func:`returning_share`). It needs a recent event
  and an old one together: a self-attention that lets a recent token see tokens beyond the gap
  can compute it; 64-token blocks or windows can't, since no block holding a recent event
  reaches the old zone. One sum over events of something per event (what pooling over the
  history computes) does not tell it either, but two, one per zone, compared with each other
  carry much of it (:func:`zone_bag_overlap`).
- ``lookback``: histories of independent events, alike at every position (nothing is
  planted in them). Categories come in two kinds (even and odd ids). The CTR logit gains
  ``W_LOOKBACK`` times the mean, over the history's high-intent events (the last action
  type), of +1 where the event ``LOOKBACK_DISTANCE`` positions earlier is of the same kind,
  -1 where it is not (:func:`lookback_balance`). Every event, every bag of events and every
  count is distributed alike whatever the term, and the term's mean is 0 whatever any one
  zone holds (a high-intent event is as likely of either kind): it depends on which event
  lies exactly that far before which, so only attention from one event to another that far
  back, reading the distance exactly (rotary positions), tells it. The distance is over 64,
  so 64-token blocks or windows never hold both events. What pooling the history into zones
  and comparing the zones can still recover is :func:`zone_lookback_balance`.
- ``recall``: histories of independent events, as in ``lookback``, except that the newest
  event's category never occurs among the ``RECALL_GAP - 1`` events before it. For half the
  samples it is the category of an event ``RECALL_GAP`` or more positions back (it *recurs*),
  for the others one that occurs nowhere in the history. The CTR logit gains ``W_RECALL``
  times +1 where it recurs, -1 where not (:func:`recall_sign`). Telling which needs the
  newest event and its match together: attention from the newest token that reaches beyond
  ``RECALL_GAP`` finds it by content alone (no distance to read, unlike ``lookback``), while a
  64-token block or window holding the newest event holds no event of its category at all.
  A pooled summary of the history that does not know the newest event (the pooled
  attention's queries are learned, or the candidate's) carries it only as far as a few
  pooled vectors can list which of the categories occurred.
- ``local``: the history signal comes only from the recent events (their affinity to the
  candidate; for CVR, their high-intent actions), so block-local attention loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gem_platform.data.config import (
    LONG_RANGE_GAP,
    LOOKBACK_DISTANCE,
    RECALL_GAP,
    RECENT_WINDOW,
)

RETURNING_SHARE = 0.5  # samples whose recent interest is one of their long-term interests
SESSION_INTERESTS = 2  # clusters of the middle zone, per sample
W_LONG_RANGE = 3.0  # CTR logit per unit of returning share (world long_range)
W_LOOKBACK = 1.5  # CTR logit per unit of lookback balance (world lookback)
W_RECALL = 1.0  # CTR logit of the newest category recurring (+1) or not (-1) (world recall)
LOOKBACK_ZONE = RECENT_WINDOW  # width of the zones zone_lookback_balance compares


@dataclass(frozen=True)
class Interests:
    """Per sample: long-term interest clusters with their cumulative weights, and the recent
    interest."""

    clusters: np.ndarray  # (n, interests)
    cdf: np.ndarray  # (n, interests)
    recent: np.ndarray  # (n,)

    def pick(self, rng: np.random.Generator, rows: np.ndarray) -> np.ndarray:
        """One long-term interest of each sample in ``rows``, drawn by weight."""
        pick = (rng.random(len(rows))[:, None] > self.cdf[rows]).sum(axis=1)
        pick = np.minimum(pick, self.clusters.shape[1] - 1)
        return self.clusters[rows, pick]


def zoned_interests(rng: np.random.Generator, n: int, num_clusters: int,
                    num_interests: int) -> Interests:
    """Each sample's own long-term interests and a recent interest that is returning (one of
    them) for ``RETURNING_SHARE`` of the samples, fresh (any cluster) for the others."""
    clusters = rng.integers(0, num_clusters, (n, num_interests))
    cdf = np.cumsum(rng.dirichlet(np.ones(num_interests), n), axis=1)
    fresh = rng.integers(0, num_clusters, n)
    returning = rng.random(n) < RETURNING_SHARE
    long_term = Interests(clusters, cdf, fresh)
    recent = np.where(returning, long_term.pick(rng, np.arange(n)), fresh)
    return Interests(clusters, cdf, recent)


def zoned_history(rng: np.random.Generator, interests: Interests, owner: np.ndarray,
                  from_end: np.ndarray, num_clusters: int) -> np.ndarray:
    """Clusters of the history events, zone by zone (see the module docstring); a tenth of
    the events in every zone are noise (any cluster)."""
    t = owner.size
    n = interests.recent.size
    session = rng.integers(0, num_clusters, (n, SESSION_INTERESTS))
    r = rng.random(t)
    session_event = session[owner, rng.integers(0, SESSION_INTERESTS, t)]
    clusters = np.where(from_end >= LONG_RANGE_GAP, interests.pick(rng, owner), session_event)
    clusters = np.where((from_end < RECENT_WINDOW) & (r < 0.7), interests.recent[owner],
                        clusters)
    return np.where(r >= 0.9, rng.integers(0, num_clusters, t), clusters)


def _positions(offsets: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """Samples, and each history event's sample and position counted from its history's end."""
    n = offsets.size - 1
    owner = np.repeat(np.arange(n), np.diff(offsets))
    return n, owner, offsets[owner + 1] - 1 - np.arange(owner.size)


def returning_share(offsets: np.ndarray, categories: np.ndarray) -> np.ndarray:
    """(n,) share of each history's recent events whose category also occurs among its old
    events (``LONG_RANGE_GAP`` or more positions from the end); 0 for an empty history."""
    n, owner, from_end = _positions(offsets)
    key = owner * (int(categories.max(initial=0)) + 1) + categories
    old = from_end >= LONG_RANGE_GAP
    recent = from_end < RECENT_WINDOW
    returning = np.isin(key[recent], key[old])
    count = np.bincount(owner[recent], minlength=n)
    return np.bincount(owner[recent], weights=returning, minlength=n) / np.maximum(count, 1)


def zone_bag_overlap(offsets: np.ndarray, categories: np.ndarray) -> np.ndarray:
    """(n,) sum over categories of the recent zone's share times the root of the old zone's
    share: what a model that sees the two zones only as bags of categories can compute.

    The model's pooled attention reads every history token (the attention ablation only
    makes the sequence tower's self-attention block-local), with each token's recency, so
    it can pool the recent and the old zone apart; the DHEN dot interaction can then compare
    the two pools. This overlap tells how much of :func:`returning_share` needs no attention
    across blocks at all."""
    n, owner, from_end = _positions(offsets)
    k = int(categories.max(initial=0)) + 1
    shares = []
    for zone in (from_end < RECENT_WINDOW, from_end >= LONG_RANGE_GAP):
        bag = np.zeros((n, k))
        np.add.at(bag, (owner[zone], categories[zone]), 1.0)
        shares.append(bag / np.maximum(bag.sum(axis=1, keepdims=True), 1.0))
    return (shares[0] * np.sqrt(shares[1])).sum(axis=1)


def mean_per_sample(owner: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """(n,) mean of ``values`` per sample (``owner`` its index per value); 0 where it has none."""
    count = np.bincount(owner, minlength=n)
    return np.bincount(owner, weights=values, minlength=n) / np.maximum(count, 1)


def kind(categories: np.ndarray) -> np.ndarray:
    """The lookback world's planted split of the categories: +1 for even ids, -1 for odd."""
    return 1.0 - 2.0 * (categories % 2)


def lookback_balance(offsets: np.ndarray, categories: np.ndarray, intent: np.ndarray
                     ) -> np.ndarray:
    """(n,) mean over each history's high-intent events (``intent``, (T,) bool) that have an
    event ``LOOKBACK_DISTANCE`` positions before them of +1 where that event's category is of
    their kind, -1 where not; 0 where none has one."""
    n, owner, _ = _positions(offsets)
    t = np.arange(owner.size)
    marks = t[intent & (t - LOOKBACK_DISTANCE >= offsets[owner])]
    agree = kind(categories[marks]) * kind(categories[marks - LOOKBACK_DISTANCE])
    return mean_per_sample(owner[marks], agree, n)


def zone_lookback_balance(offsets: np.ndarray, categories: np.ndarray, intent: np.ndarray,
                          width: int = LOOKBACK_ZONE) -> np.ndarray:
    """(n,) :func:`lookback_balance` as seen through zones of ``width`` positions (counted from
    the end): each high-intent event's kind times the mean kind of the zone
    ``LOOKBACK_DISTANCE`` further back than its own zone, averaged over those events.
    What a model that pools every zone apart and compares each with the one that far back can
    compute, knowing distances to a zone's width only; the model's pooled attention reads
    every token with its recency, and the DHEN dot interaction compares pools, so this bounds
    what block-local attention can still reach of the term."""
    n, owner, from_end = _positions(offsets)
    zone = from_end // width
    zones = int(zone.max(initial=0)) + 1
    kinds = np.zeros((n, zones))
    seen = np.zeros((n, zones))
    np.add.at(kinds, (owner, zone), kind(categories))
    np.add.at(seen, (owner, zone), 1.0)
    back = zone + LOOKBACK_DISTANCE // width
    marks = np.flatnonzero(intent & (back < zones))
    marks = marks[seen[owner[marks], back[marks]] > 0]
    mean_back = kinds[owner[marks], back[marks]] / seen[owner[marks], back[marks]]
    return mean_per_sample(owner[marks], kind(categories[marks]) * mean_back, n)


def recall_history(rng: np.random.Generator, offsets: np.ndarray, num_clusters: int
                   ) -> np.ndarray:
    """(T,) categories of the recall world's events: independent and uniform, then each
    history's newest event set to a category of an event ``RECALL_GAP`` or more back (half
    the samples) or to one absent from the whole history (the others, where one is), and
    every event of the newest one's category among the ``RECALL_GAP - 1`` before it redrawn."""
    n, owner, from_end = _positions(offsets)
    cats = rng.integers(0, num_clusters, owner.size)
    if owner.size == 0:
        return cats
    old = from_end >= RECALL_GAP
    present = np.zeros((n, num_clusters), dtype=bool)
    present[owner[old], cats[old]] = True
    # a random old event's category: its position drawn uniformly among the sample's old ones
    old_count = np.maximum(np.diff(offsets) - RECALL_GAP, 0)
    pick = offsets[:-1] + (rng.random(n) * old_count).astype(np.int64)
    recurring = cats[np.minimum(pick, owner.size - 1)]
    # a uniformly drawn absent category (any, where none is absent)
    absent = np.where(present, -1.0, rng.random((n, num_clusters))).argmax(axis=1)
    choice = np.where((rng.random(n) < 0.5) & (old_count > 0), recurring, absent)
    newest = from_end == 0
    cats[newest] = choice[owner[newest]]
    near = (from_end > 0) & (from_end < RECALL_GAP) & (cats == choice[owner])
    cats[near] = (cats[near] + rng.integers(1, num_clusters, int(near.sum()))) % num_clusters
    return cats


def recall_sign(offsets: np.ndarray, categories: np.ndarray) -> np.ndarray:
    """(n,) +1 where the newest event's category occurs ``RECALL_GAP`` or more positions
    before it, -1 where not; 0 for an empty history."""
    n, owner, from_end = _positions(offsets)
    newest = from_end == 0
    newest_cat = np.full(n, -1)
    newest_cat[owner[newest]] = categories[newest]
    old = from_end >= RECALL_GAP
    found = np.zeros(n, dtype=bool)
    found[owner[old][categories[old] == newest_cat[owner[old]]]] = True
    return np.where(np.diff(offsets) > 0, np.where(found, 1.0, -1.0), 0.0)
