"""The linear reference's result and its cache: one JSON file inside the dataset directory,
keyed by the dataset's digest, the reference's version and its configuration, so it is
computed once per dataset and recomputed when any changes. The default configuration (what
runs compare against) is cached in ``reference-linear.json``; any other in a file named by
its configuration's hash, so trying another setting never evicts the default's.

The file is written atomically (a temporary sibling renamed over it) and only into a local
dataset directory (one holding the meta.json the platform writes); a file of that name that
the platform did not write is never replaced. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gem_platform.data.meta import META_FILE
from gem_platform.reference.config import LinearReferenceConfig

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference-linear.json"
KIND = "gem.reference.linear"
METRIC_PREFIX = "reference/linear/"
TASK_FIELDS = ("ne", "auc", "calibration", "log_loss", "base_rate", "count")


@dataclass
class LinearReference:
    """Held-out scores of the linear reference on one dataset (``tasks[task][field]`` with
    fields ``TASK_FIELDS``), and how it was obtained."""

    version: int
    dataset_digest: str | None
    tasks: dict[str, dict[str, float]]
    train_samples: int
    num_features: int
    fit_s: float
    config: dict[str, Any] = field(default_factory=dict)
    kind: str = KIND

    def metrics(self) -> dict[str, float]:
        """``reference/linear/<ne|auc|calibration>_<task>``: what runs log and summarize."""
        return {f"{METRIC_PREFIX}{name}_{task}": float(scores[name])
                for task, scores in self.tasks.items()
                for name in ("ne", "auc", "calibration")}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LinearReference:
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("kind") != KIND:
            raise ValueError("not a linear reference")
        return cls(**raw)


def is_local_dataset(path: str | Path) -> bool:
    """A local directory holding a dataset's meta.json (where the cache may live)."""
    return "://" not in str(path) and (Path(path) / META_FILE).is_file()


def reference_file(path: str | Path, config: dict[str, Any]) -> Path:
    """The cache file of the reference of ``config`` in the dataset directory ``path``."""
    if config == LinearReferenceConfig().as_dict():
        return Path(path) / REFERENCE_FILE
    tag = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    return Path(path) / f"reference-linear-{tag}.json"


def load_cached(path: str | Path, digest: str | None, version: int,
                config: dict[str, Any]) -> LinearReference | None:
    """The cached reference of this dataset digest, version and config, or None (absent,
    unreadable, stale or not ours)."""
    if digest is None or not is_local_dataset(path):
        return None
    file = reference_file(path, config)
    try:
        ref = LinearReference.from_json(file.read_text())
    except (OSError, ValueError, TypeError):
        return None
    if ref.dataset_digest != digest or ref.version != version or ref.config != config:
        return None
    return ref


def _ours_or_absent(file: Path) -> bool:
    if not file.exists():
        return True
    try:
        LinearReference.from_json(file.read_text())
    except (OSError, ValueError, TypeError):
        return False
    return True


def store(path: str | Path, ref: LinearReference) -> Path | None:
    """Write ``ref`` beside the dataset; returns the file, or None where it may not or could
    not be written (not a local dataset directory, a foreign file in the way, read-only)."""
    if ref.dataset_digest is None or not is_local_dataset(path):
        return None
    file = reference_file(path, ref.config)
    if not _ours_or_absent(file):
        log.warning("%s was not written by the platform; the linear reference is not cached",
                    file)
        return None
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(ref.to_json())
        os.replace(tmp, file)
    except OSError as err:
        log.warning("could not cache the linear reference in %s (%s)", path, err)
        tmp.unlink(missing_ok=True)
        return None
    return file
