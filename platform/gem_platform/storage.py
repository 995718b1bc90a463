"""Where a Ray run keeps its checkpoints and Ray Train's run folder: ``train.storage``.

A multi-node run needs storage every node sees: a shared path (an NFS or similar mount at the
same path on every node) or an object-store URI (``s3://bucket/prefix``, ``gs://...``;
credentials and endpoints come from the environment, e.g. AWS_* variables and
AWS_ENDPOINT_URL for an S3-compatible server). Unset, it is ``gem_runs/ray`` under the
driver's working directory, which only a single-node cluster shares.

Each MLflow run gets the folder ``<storage>/<recipe name>-<run id[:8]>``, stable across
resumes, which Ray Train fills with checkpoint folders (each holding ``gem_step.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from gem_platform.data.remote import bounded_on
from gem_platform.data.source import filesystem, is_remote
from gem_platform.errors import GemError
from gem_platform.recipe import Recipe

DEFAULT_STORAGE = "gem_runs/ray"
STEP_FILE = "gem_step.json"  # what a complete checkpoint folder holds (checkpoint/store.py)


class StorageError(GemError):
    """``train.storage`` can't be reached or written."""


def storage_root(recipe: Recipe) -> str:
    """``train.storage`` as Ray Train's ``storage_path``: a URI as given, a local path
    absolute."""
    where = recipe.train.storage or DEFAULT_STORAGE
    if is_remote(where):
        return where.rstrip("/")
    return str(Path(where.removeprefix("file://")).expanduser().resolve())


def run_dir_name(recipe: Recipe, run_id: str) -> str:
    return f"{recipe.name}-{run_id[:8]}"


def run_dir(recipe: Recipe, run_id: str) -> str:
    """This MLflow run's folder in the storage (a URI or an absolute local path)."""
    return f"{storage_root(recipe)}/{run_dir_name(recipe, run_id)}"


def check_storage(recipe: Recipe) -> None:
    """Fail fast, naming ``train.storage``, when the storage can't be listed or written."""
    root = storage_root(recipe)
    try:
        fs, path = filesystem(root)
        bounded_on(fs, lambda: _write_probe(fs, path), f"writing to {root}")
    except (OSError, pa.ArrowException, GemError) as e:
        raise StorageError(
            f"train.storage {root!r} can't be written ({e}).",
            "Point train.storage at a path every node mounts or an object-store URI this "
            "machine's credentials can write (for S3-compatible servers set "
            "AWS_ENDPOINT_URL).") from None


def _write_probe(fs: pafs.FileSystem, path: str) -> None:
    fs.create_dir(path, recursive=True)
    probe = f"{path}/.gem-write-probe"
    with fs.open_output_stream(probe) as f:
        f.write(b"ok")
    fs.delete_file(probe)


def latest_checkpoint(directory: str) -> str | None:
    """The complete checkpoint with the highest step under ``directory`` (local or remote),
    or None."""
    fs, path = filesystem(directory)
    try:
        infos = bounded_on(fs, lambda: fs.get_file_info(pafs.FileSelector(
            path, recursive=True, allow_not_found=True)), f"listing {directory}")
    except (OSError, pa.ArrowException):
        return None
    best: tuple[int, str] | None = None
    for info in infos:
        if info.type != pafs.FileType.File or info.base_name != STEP_FILE:
            continue
        try:
            with fs.open_input_stream(info.path) as f:
                step = int(json.loads(f.read().decode())["step"])
        except (OSError, ValueError, KeyError, pa.ArrowException):
            continue
        folder = info.path.rsplit("/", 1)[0]
        if best is None or step > best[0]:
            best = (step, folder)
    if best is None:
        return None
    if is_remote(directory):
        scheme = directory.split("://", 1)[0]
        return f"{scheme}://{best[1]}"
    return best[1]


__all__ = ["DEFAULT_STORAGE", "StorageError", "check_storage", "is_remote", "latest_checkpoint",
           "run_dir", "run_dir_name", "storage_root"]
