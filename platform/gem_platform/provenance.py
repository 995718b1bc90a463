"""Where a result came from: the code (git commit and whether the tree was dirty), the dataset
(its meta.json plus every shard's size and checksum), and the environment (device and library
versions). Every tracked run, sweep parent run, in-process results file, benchmark and
profile report records it (the environment at least).

- ``code_version``: from git at the source tree (dirty: a tracked file differs from the
  commit); outside a git checkout (an installed
  package, a container image) from ``GEM_GIT_COMMIT`` / ``GEM_GIT_DIRTY`` if the image sets
  them, else unknown (None).
- ``dataset_fingerprint``: a digest over meta.json and each shard's name, size and sha256;
  checksums are cached per process by (path, size, mtime), so a sweep hashes a dataset once.
- ``environment``: library versions from package metadata; nothing here imports Ray or MLflow
  (the in-process runner's GPU box has neither). MLflow logging lives in ``record_run`` and
  imports MLflow only when called.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform as _platform
import subprocess
import warnings
from pathlib import Path
from typing import Any

SOURCE_ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("torch", "triton", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "torchmetrics",
             "numpy", "pyarrow", "ray", "mlflow")
TAG_COMMIT, TAG_DIRTY, TAG_DATASET = "gem.git_commit", "gem.git_dirty", "gem.dataset_digest"
TAG_DEVICE = "gem.device"  # the accelerator rank 0 trained on (the run summary's "device")
_SHARD_SUMS: dict[tuple[str, int, int], str] = {}


def _git(*args: str, root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                             timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def code_version(root: Path = SOURCE_ROOT) -> dict[str, Any]:
    """{"commit": sha or None, "dirty": bool or None}: None where it can't be known.

    ``GEM_GIT_COMMIT`` (and ``GEM_GIT_DIRTY``), when set, win over git: they name the code of
    an export or image that may sit inside some other checkout whose HEAD is not its code."""
    # empty counts as unset: an image built without the build arguments sets both to ""
    env_commit = os.environ.get("GEM_GIT_COMMIT") or None
    env_dirty = os.environ.get("GEM_GIT_DIRTY") or None
    commit = None if env_commit else _git("rev-parse", "HEAD", root=root)
    if commit is None:
        return {"commit": env_commit or None,
                "dirty": None if env_dirty is None else env_dirty.lower() in ("1", "true")}
    status = _git("status", "--porcelain", "--untracked-files=no", root=root)
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def _sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHARD_SUMS:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _SHARD_SUMS[key] = h.hexdigest()
    return _SHARD_SUMS[key]


def dataset_fingerprint(path: str | Path) -> dict[str, Any]:
    """The dataset directory's meta, each shard's size and sha256, and one digest of them all.

    Raises FileNotFoundError when ``path`` holds no meta.json (a dataset not prepared yet)."""
    from gem_platform.data.meta import META_FILE

    root = Path(path)
    meta_path = root / META_FILE
    meta = json.loads(meta_path.read_text())
    shards = [{"file": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)}
              for p in sorted(root.glob("*.parquet"))]
    blob = json.dumps({"meta": meta, "shards": shards}, sort_keys=True).encode()
    return {"path": str(root.resolve()), "digest": hashlib.sha256(blob).hexdigest()[:16],
            "source": meta.get("source"), "num_train": meta.get("num_train"),
            "num_eval": meta.get("num_eval"), "shards": shards, "meta": meta}


def environment() -> dict[str, Any]:
    """Python, OS, device and the installed versions of the libraries a result depends on."""
    libs = {}
    for name in LIBRARIES:
        try:
            libs[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    out: dict[str, Any] = {"python": _platform.python_version(), "os": _platform.platform(),
                           "libraries": libs}
    import torch

    out["device"] = device_name()
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
    return out


def device_name(device: Any = None) -> str:
    """The accelerator ``device`` (a torch.device; default this process's) names itself by
    ("NVIDIA H200"), or "cpu (N cores)": the same seed on another card is another sample."""
    import torch

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def provenance(data_path: str | Path | None = None) -> dict[str, Any]:
    """The full record: code, environment and (when ``data_path`` holds a prepared dataset)
    the dataset's fingerprint."""
    out: dict[str, Any] = {"code": code_version(), "environment": environment()}
    if data_path is not None:
        try:
            out["dataset"] = dataset_fingerprint(data_path)
        except FileNotFoundError:
            out["dataset"] = None
    return out


def dataset_tag(record: dict[str, Any]) -> str | None:
    data = record.get("dataset")
    return data["digest"] if data else None


class SystemMetrics:
    """MLflow's system metrics (CPU, memory, disk, network, GPU) for one run, sampled on
    this process (the driver) until ``stop``. Sampling interval: MLflow's own
    MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL (default 10 s)."""

    def __init__(self, uri: str, run_id: str, resumed: bool = False) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self._monitor = SystemMetricsMonitor(run_id, resume_logging=resumed, tracking_uri=uri)
        self._monitor.start()

    def stop(self) -> None:
        self._monitor.finish()


def log_dataset(uri: str, run_id: str, dataset: dict[str, Any], context: str) -> None:
    """Log the dataset as an MLflow dataset input of the run (its digest, source and shard
    count as the profile)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.tracking import MlflowClient
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    name = f"{dataset.get('source') or 'dataset'}@{Path(dataset['path']).name}"
    with warnings.catch_warnings():  # a local path matches two registered source kinds
        warnings.simplefilter("ignore", UserWarning)
        source = resolve_dataset_source(dataset["path"])
    ds = MetaDataset(source, name=name, digest=dataset["digest"])
    meta = ds._to_mlflow_entity()
    entity = Dataset(meta.name, meta.digest, meta.source_type, meta.source, meta.schema,
                     json.dumps({"num_train": dataset.get("num_train"),
                                 "num_eval": dataset.get("num_eval"),
                                 "shards": len(dataset.get("shards", []))}))
    MlflowClient(tracking_uri=uri).log_inputs(
        run_id, [DatasetInput(entity, [InputTag(MLFLOW_DATASET_CONTEXT, context)])])


def record_run(tracker: Any, params: dict[str, Any], resumed: bool = False
               ) -> SystemMetrics | None:
    """Record provenance on a run the driver just opened: tags (commit, dirty, dataset
    digest), ``provenance.json``, the dataset as an MLflow dataset input (when the params
    name a prepared ``data.path``), and start system metrics. Returns the system metrics
    handle to stop when the run ends (None if they could not start)."""
    record = provenance(params.get("data.path"))
    code = record["code"]
    tracker.set_tag(TAG_COMMIT, code["commit"] or "unknown")
    tracker.set_tag(TAG_DIRTY, str(code["dirty"]).lower())
    if record.get("dataset"):
        tracker.set_tag(TAG_DATASET, record["dataset"]["digest"])
        log_dataset(tracker.uri, tracker.run_id, record["dataset"], "training")
    if not resumed:
        tracker.log_json(record, "provenance.json")
    try:
        return SystemMetrics(tracker.uri, tracker.run_id, resumed)
    except ImportError:  # psutil missing: the run is still recorded, without system metrics
        return None
