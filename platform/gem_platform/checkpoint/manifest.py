"""A checkpoint's manifest: every file of the checkpoint with its size and CRC-32, written
after all of them are durable, so that a torn checkpoint (a save cut short, a truncated or
damaged file) is recognized before a resume loads it.

The order follows torch.distributed.checkpoint, which fsyncs every shard before it writes its
``.metadata`` index (to a temporary name, fsync'd, then renamed): the manifest is the last file
of a checkpoint, written the same way, after the shards, the rank files and ``gem_step.json``
are fsync'd. A checkpoint without it never finished saving.

CRC-32 (``zlib.crc32``, streamed in blocks) is the checksum: the manifest guards against
accidents (a killed writer, a full disk, a partial copy or upload, flipped bits), not against
someone forging files, and CRC-32 detects those at about twice the speed of SHA-256 on the
same CPU, which matters for shards of many gigabytes read at every save and resume. It is also
the checksum every ``torch.save`` zip entry carries.

No torch here: the driver checks checkpoints before it touches the run's record.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

MANIFEST_FILE = "gem_manifest.json"
STEP_FILE = "gem_step.json"
# gem_step.json of a checkpoint that carries a manifest says so; one without "format" comes
# from the code before manifests (a legacy checkpoint).
FORMAT = 2
BLOCK = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its name in the folder, size in bytes and CRC-32 (hex)."""

    name: str
    size: int
    crc32: str


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds: its step and every file."""

    step: int
    files: list[FileEntry]

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "step": self.step,
                           "files": [asdict(f) for f in self.files]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest; ValueError (with what is wrong) when it is not one."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or not isinstance(raw.get("files"), list):
            raise ValueError("it has no list of files")
        try:
            files = [FileEntry(str(f["name"]), int(f["size"]), str(f["crc32"]))
                     for f in raw["files"]]
            return cls(int(raw["step"]), files)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"an entry is malformed ({err!r})") from None


def crc32_of(stream: BinaryIO) -> tuple[int, str]:
    """Size and CRC-32 (8 hex digits) of everything left in ``stream``, read in blocks."""
    crc, size = 0, 0
    while block := stream.read(BLOCK):
        crc = zlib.crc32(block, crc)
        size += len(block)
    return size, f"{crc:08x}"


def durable_entry(path: Path) -> FileEntry:
    """fsync ``path`` (it must be on disk before a manifest may name it) and describe it."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        size, crc = crc32_of(f)
    return FileEntry(path.name, size, crc)


def fsync_dir(directory: Path) -> None:
    """Make the folder's entries (new names, renames) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary name: fsync'd, renamed, folder fsync'd,
    so ``path`` is either absent or whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_step_file(directory: Path, step: int) -> None:
    write_durably(directory / STEP_FILE, json.dumps({"step": step, "format": FORMAT}))


def write_manifest(directory: Path, step: int, files: Iterable[FileEntry]) -> None:
    """The checkpoint's last file: call it when every file in ``files`` is durable."""
    ordered = sorted(files, key=lambda f: f.name)
    write_durably(directory / MANIFEST_FILE, Manifest(step, ordered).to_json())


def forget_completion(directory: Path) -> None:
    """Before saving into a folder that may hold an older save: remove what marks it complete,
    so a save cut short there is recognized as torn."""
    for name in (MANIFEST_FILE, STEP_FILE):
        (directory / name).unlink(missing_ok=True)
