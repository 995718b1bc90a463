"""What generation and conversion may replace: only a folder their own writer made.

A dataset folder is replaced whole (staging.py), so everything in it goes. It may be replaced
only when nothing in it can be the user's: it is absent or empty, or it holds a meta.json that
the same writer wrote (checked field by field, carrying that writer's fingerprint) and
otherwise only shards named as every writer names them (no more than the meta.json lists, where
it counts them) and files the platform keeps beside a dataset (JSON whose ``kind`` is the
platform's, e.g. the linear reference's cache, and their temporary files). Anything else (a
foreign or unreadable meta.json, another writer's dataset, a file the user put beside the
shards, a file or a link where the folder should be) is refused, naming the folder, why, and
what to do.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gem_platform.data.meta import META_FILE, DatasetMeta, is_count
from gem_platform.errors import DataError

SHARD_NAME = re.compile(r"(train|eval)-(\d{5})\.parquet")
OWN_NAME = re.compile(SHARD_NAME.pattern + "|" + re.escape(META_FILE))
COMPANION = re.compile(r"[a-z0-9-]+\.json")  # e.g. reference-linear.json
COMPANION_TEMP = re.compile(r"\.[a-z0-9-]+\.json\.tmp-\d+")  # one being written
PLATFORM_KIND = "gem."  # the prefix of ``kind`` in every JSON file the platform keeps


@dataclass(frozen=True)
class Writer:
    """A program that writes dataset folders: its name in messages, and ``foreign``, which
    says why a (checked) meta.json is not one it wrote, or None when it is."""

    name: str
    foreign: Callable[[DatasetMeta], str | None]


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _platform_file(folder: Path, name: str) -> bool:
    """A shard, meta.json or companion file (by name, and by content for a companion)."""
    path = folder / name
    if path.is_symlink() or not path.is_file():
        return False
    if OWN_NAME.fullmatch(name) or COMPANION_TEMP.fullmatch(name):
        return True
    if not COMPANION.fullmatch(name):
        return False
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return False
    kind = raw.get("kind") if isinstance(raw, dict) else None
    return isinstance(kind, str) and kind.startswith(PLATFORM_KIND)


def foreign_reason(out: Path, writer: Writer) -> str | None:
    """Why replacing ``out`` could lose something ``writer`` did not write; None when it is
    safe (absent, empty, or wholly the writer's). OSError (permissions, names) propagates."""
    if out.is_symlink():
        return "is a symbolic link; replacing it would drop the link"
    if not out.exists():
        return None
    if not out.is_dir():
        return "is a file, not a dataset folder"
    entries = sorted(os.listdir(out))
    others = [e for e in entries if not _platform_file(out, e)]
    if others:
        return f"holds {_listed(others)}, which {writer.name} did not write"
    if not any(OWN_NAME.fullmatch(e) for e in entries):
        return None  # empty, or only what the platform keeps beside a dataset
    if META_FILE not in entries:
        return f"holds shards but no {META_FILE}, so nothing says who wrote them"
    try:
        meta = DatasetMeta.load(out)
    except DataError as err:
        return f"holds a {META_FILE} that {writer.name} did not write ({err.problem.rstrip('.')})"
    why = writer.foreign(meta)
    if why is not None:
        return f"holds a dataset {writer.name} did not write ({why})"
    unlisted = _unlisted_shards(entries, meta)
    return f"holds {_listed(unlisted)}, which its {META_FILE} does not list" if unlisted else None


def _unlisted_shards(entries: list[str], meta: DatasetMeta) -> list[str]:
    """Shards beyond the counts a writer recorded (``extra.shards``): not of this dataset."""
    counts = meta.extra.get("shards")
    if not isinstance(counts, dict):
        return []  # a writer that does not record its shards
    unlisted = []
    for name in entries:
        match = SHARD_NAME.fullmatch(name)
        if match and not (is_count(counts.get(match[1])) and int(match[2]) < counts[match[1]]):
            unlisted.append(name)
    return unlisted


def check_replaceable(out: Path, what: str, writer: Writer) -> None:
    """Refuse (DataError) to replace ``out`` unless ``foreign_reason`` finds nothing; ``what``
    names the setting that chose ``out`` (e.g. "data.path"). Only a folder that holds a dataset
    is suggested for removal; a file, a link or any other folder never is."""
    why = foreign_reason(out, writer)
    if why is None:
        return
    if not out.is_symlink() and (out / META_FILE).is_file():  # another dataset: may be spent
        fix = (f"Choose another {what}, or remove {str(out)!r} yourself if nothing in it is "
               "needed.")
    else:  # a file, a link, or a folder that is no dataset ('.', a project): never offered
        fix = f"Choose another {what}: a new or empty folder, or one {writer.name} wrote."
    raise DataError(f"{what} {str(out)!r} {why}; replacing the folder would delete what is "
                    "there, so nothing was written.", fix)


__all__ = ["OWN_NAME", "Writer", "check_replaceable", "foreign_reason"]
