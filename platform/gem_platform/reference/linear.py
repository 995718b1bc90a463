"""The linear reference of a dataset: from the cache beside it, or trained and scored now
(then cached). What ``gemctl data reference`` prints and a run's summary shows."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gem_platform.data.meta import DatasetMeta
from gem_platform.reference.cache import (
    TASK_FIELDS,
    LinearReference,
    is_local_dataset,
    load_cached,
    reference_file,
    store,
)
from gem_platform.reference.config import VERSION, LinearReferenceConfig

log = logging.getLogger(__name__)

# Largest train split a run's summary trains the reference for when none is cached; larger
# datasets show it once `gemctl data reference` has cached it.
ON_DEMAND_MAX_TRAIN = 200_000


@dataclass
class ReferenceOutcome:
    """The reference, whether it came from the cache, and where it is cached (None: not)."""

    reference: LinearReference
    cached: bool
    cache_file: str | None


def dataset_digest(path: str | Path) -> str | None:
    """The dataset's provenance digest (meta.json and every shard's checksum); None for a
    dataset that is not a local directory (its reference is computed, never cached)."""
    if not is_local_dataset(path):
        return None
    from gem_platform.provenance import dataset_fingerprint

    return str(dataset_fingerprint(path)["digest"])


def cached_reference(path: str | Path, cfg: LinearReferenceConfig | None = None
                     ) -> LinearReference | None:
    """The cached reference of the dataset at ``path`` as it is now, or None."""
    cfg = cfg or LinearReferenceConfig()
    return load_cached(path, dataset_digest(path), VERSION, cfg.as_dict())


def linear_reference(path: str, meta: DatasetMeta, *, force: bool = False,
                     cfg: LinearReferenceConfig | None = None) -> ReferenceOutcome:
    """The dataset's linear reference: cached unless ``force`` or stale, else trained on the
    train split, scored on the eval split and cached beside the dataset."""
    cfg = cfg or LinearReferenceConfig()
    digest = dataset_digest(path)
    if not force:
        hit = load_cached(path, digest, VERSION, cfg.as_dict())
        if hit is not None:
            return ReferenceOutcome(hit, True, str(reference_file(path, cfg.as_dict())))
    from gem_platform.reference.fit import fit_and_score  # torch

    started = time.monotonic()
    fitted = fit_and_score(path, meta, cfg)
    ref = LinearReference(
        version=VERSION, dataset_digest=digest,
        tasks={task: {name: float(getattr(scores, name)) for name in TASK_FIELDS}
               for task, scores in fitted.scores.items()},
        train_samples=fitted.train_samples, num_features=fitted.num_features,
        fit_s=time.monotonic() - started, config=cfg.as_dict())
    file = store(path, ref)
    return ReferenceOutcome(ref, False, str(file) if file else None)


def summary_metrics(path: str, meta: DatasetMeta,
                    echo: Callable[[str], None] | None = None) -> dict[str, float]:
    """``reference/linear/*`` metrics for a run's summary: the cached reference, or one
    computed now when the train split is small enough to take seconds; empty otherwise."""
    try:
        hit = cached_reference(path)
        if hit is not None:
            return hit.metrics()
        if meta.num_train > ON_DEMAND_MAX_TRAIN:
            return {}
        if echo:
            echo("linear reference: training it once for this dataset (then cached)")
        return linear_reference(path, meta).reference.metrics()
    except Exception as err:  # a run that trained never fails for its reference
        log.warning("linear reference unavailable: %s", err)
        return {}
