"""Which checkpoint a resume may load: the newest intact one, with what was skipped and why.

A checkpoint is intact when its manifest (manifest.py) lists files that are all present with
the listed size and CRC-32. One without a manifest is torn when its ``gem_step.json`` says it
was written with manifests (its save stopped before the end), and legacy otherwise: written by
the code before manifests, it is taken when its files read back (``gem_step.json`` parses, the
DCP index ``.metadata`` unpickles and every shard holds the bytes the index points at, every
``rank<N>.pt`` zip passes its own CRC check), so runs saved before manifests still resume.

Like TorchTitan's search for the highest step that can be loaded, candidates are checked
newest first and the search stops at the first intact one; unlike a bare "newest folder with
an index" rule, a torn newest checkpoint is named and passed over instead of failing the load.

Folders are read through pyarrow's filesystems, so the same check runs on local folders and
on a Ray run's object storage. No torch at import: the driver checks before it touches the
run's record (a legacy check unpickles ``.metadata``, which imports torch's DCP classes).
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs

from gem_platform.checkpoint.manifest import FORMAT, MANIFEST_FILE, STEP_FILE, Manifest, crc32_of
from gem_platform.data.source import filesystem, is_remote
from gem_platform.errors import GemError

DCP_INDEX = ".metadata"
MARKERS = (STEP_FILE, MANIFEST_FILE, DCP_INDEX)  # a folder holding one is a checkpoint's
RANK_FILE = re.compile(r"rank\d+\.pt")
STEP_FOLDER = re.compile(r"step_(\d+)")


class CheckpointError(GemError):
    """No checkpoint of a run can be resumed from."""


@dataclass(frozen=True)
class Verdict:
    """What a check found in one checkpoint folder: ``reason`` says why it is torn (None:
    intact); ``legacy``: it has no manifest and was checked by reading its files."""

    folder: str
    step: int | None
    reason: str | None = None
    legacy: bool = False

    @property
    def intact(self) -> bool:
        return self.reason is None

    @property
    def name(self) -> str:
        return self.folder.rstrip("/").rsplit("/", 1)[-1]

    def describe(self) -> str:
        return self.name + (f" (step {self.step})" if self.step is not None else "")


@dataclass
class ResumePoint:
    """The checkpoint a resume loads (``folder`` None: the run has none) and the newer ones it
    passes over."""

    root: str
    folder: str | None = None
    step: int | None = None
    legacy: bool = False
    skipped: list[Verdict] = field(default_factory=list)

    def skip_lines(self) -> list[str]:
        return [f"skipped checkpoint {v.describe()}: {v.reason}" for v in self.skipped]

    def notes(self) -> list[str]:
        if not (self.legacy and self.folder):
            return []
        name = self.folder.rstrip("/").rsplit("/", 1)[-1]
        return [f"checkpoint {name} has no manifest (saved before checkpoints carried "
                "checksums): taken as intact because its files read back"]

    def lines(self) -> list[str]:
        """One line per skipped checkpoint, a note for a legacy one, and the choice."""
        chosen = []
        if self.folder:
            name = self.folder.rstrip("/").rsplit("/", 1)[-1]
            chosen = [f"resuming from {name} (step {self.step}, {self.folder})"]
        return [*self.skip_lines(), *self.notes(), *chosen]


class _Folder:
    """One checkpoint folder on a pyarrow filesystem: its files' sizes, their bytes."""

    def __init__(self, fs: pafs.FileSystem, path: str) -> None:
        self.fs, self.path = fs, path.rstrip("/")
        infos = fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        self.sizes = {i.base_name: int(i.size) for i in infos if i.type == pafs.FileType.File}

    def read(self, name: str) -> bytes:
        with self.fs.open_input_stream(f"{self.path}/{name}") as f:
            return f.read()

    def crc32(self, name: str) -> tuple[int, str]:
        with self.fs.open_input_stream(f"{self.path}/{name}") as f:
            return crc32_of(f)


def _step_record(folder: _Folder) -> tuple[int | None, int, str | None]:
    """``gem_step.json``'s step and format (1: before manifests), or why it can't be read."""
    if STEP_FILE not in folder.sizes:
        return None, 1, f"{STEP_FILE} is missing (its save did not finish)"
    try:
        record = json.loads(folder.read(STEP_FILE).decode())
        return int(record["step"]), int(record.get("format", 1)), None
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return None, 1, f"{STEP_FILE} is not a step record (truncated or overwritten)"


def _against_manifest(folder: _Folder) -> tuple[int | None, str | None]:
    """The manifest's step and why the folder's files don't match it (None: they do)."""
    try:
        manifest = Manifest.from_json(folder.read(MANIFEST_FILE).decode())
    except (ValueError, UnicodeDecodeError) as err:
        return None, f"{MANIFEST_FILE} can't be read ({err})"
    for entry in manifest.files:
        if entry.name not in folder.sizes:
            return manifest.step, f"{entry.name} is missing"
        if folder.sizes[entry.name] != entry.size:
            return manifest.step, (f"{entry.name} is {folder.sizes[entry.name]} bytes, its "
                                   f"manifest says {entry.size} (truncated or replaced)")
    for entry in manifest.files:
        size, crc = folder.crc32(entry.name)
        if (size, crc) != (entry.size, entry.crc32):
            return manifest.step, (f"{entry.name} does not match its checksum in the manifest "
                                   f"(CRC-32 {crc}, expected {entry.crc32}): the file is "
                                   "damaged")
    return manifest.step, None


def _legacy_problem(folder: _Folder) -> str | None:
    """Why a checkpoint without a manifest can't be loaded, or None when its files read back:
    the DCP index, the shard extents it points at and each rank file's zip CRCs."""
    if DCP_INDEX not in folder.sizes:
        return f"{DCP_INDEX} (the index of its tensor shards) is missing"
    try:
        index = pickle.loads(folder.read(DCP_INDEX))
        extents: dict[str, int] = {}
        for info in index.storage_data.values():
            end = int(info.offset) + int(info.length)
            extents[info.relative_path] = max(end, extents.get(info.relative_path, 0))
    except Exception as err:  # any unpickling failure means the index is damaged
        return f"{DCP_INDEX} can't be read ({type(err).__name__}: {str(err)[:200]})"
    for name, end in sorted(extents.items()):
        if name not in folder.sizes:
            return f"{name} is missing"
        if folder.sizes[name] < end:
            return f"{name} is {folder.sizes[name]} bytes, its index needs {end} (truncated)"
    ranks = sorted(n for n in folder.sizes if RANK_FILE.fullmatch(n))
    if not ranks:
        return "it has no rank0.pt"
    for name in ranks:
        try:
            with zipfile.ZipFile(io.BytesIO(folder.read(name))) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as err:
            return f"{name} is truncated or damaged ({err})"
        if bad is not None:
            return f"{name} is damaged (its entry {bad} fails its CRC check)"
    return None


def _check(folder: _Folder, where: str) -> Verdict:
    step, written_as, step_problem = _step_record(folder)
    if MANIFEST_FILE in folder.sizes:
        listed, problem = _against_manifest(folder)
        return Verdict(where, listed if listed is not None else step, problem)
    if written_as >= FORMAT:
        return Verdict(where, step, f"{MANIFEST_FILE} is missing (its save did not finish)")
    if step_problem:
        return Verdict(where, step, step_problem, legacy=True)
    return Verdict(where, step, _legacy_problem(folder), legacy=True)


def check_checkpoint(folder: str) -> Verdict:
    """Whether the checkpoint in ``folder`` (a local path or an object-store URI) is intact,
    and why not."""
    fs, path = filesystem(folder)
    try:
        return _check(_Folder(fs, path), folder)
    except (OSError, pa.ArrowException) as err:
        return Verdict(folder, None, f"it can't be read ({err})")


def _sort_key(fs: pafs.FileSystem, path: str) -> float:
    """Newest first: the step its manifest or step file records, else its folder name's;
    a folder whose step can't be told is checked before all others."""
    folder = _Folder(fs, path)
    for name in (MANIFEST_FILE, STEP_FILE):
        if name in folder.sizes:
            try:
                return float(int(json.loads(folder.read(name).decode())["step"]))
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                pass
    m = STEP_FOLDER.fullmatch(path.rsplit("/", 1)[-1])
    return float(m.group(1)) if m else float("inf")


def _candidates(root: str) -> list[str]:
    """Checkpoint folders under ``root`` (searched recursively), newest first, as paths of
    ``root``'s filesystem."""
    fs, base = filesystem(root)
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    folders = {i.path.rsplit("/", 1)[0] for i in infos
               if i.type == pafs.FileType.File and i.base_name in MARKERS}
    return sorted(folders, key=lambda p: _sort_key(fs, p), reverse=True)


def _as_root(root: str, path: str) -> str:
    return f"{root.split('://', 1)[0]}://{path}" if is_remote(root) else path


def find_resume_point(root: str) -> ResumePoint:
    """The newest intact checkpoint under ``root`` and the newer torn ones passed over; a
    point with no folder when ``root`` holds no checkpoint. CheckpointError, naming each
    checkpoint and why it is torn, when none is intact."""
    try:
        folders = [_as_root(root, p) for p in _candidates(root)]
    except (OSError, pa.ArrowException) as err:
        raise CheckpointError(f"The checkpoints in {root} can't be listed ({err}).",
                              "Check that the storage is reachable and readable.") from None
    point = ResumePoint(root)
    for folder in folders:
        verdict = check_checkpoint(folder)
        if verdict.intact:
            point.folder, point.step, point.legacy = folder, verdict.step, verdict.legacy
            return point
        point.skipped.append(verdict)
    if point.skipped:
        reasons = "; ".join(f"{v.describe()}: {v.reason}" for v in point.skipped)
        raise CheckpointError(
            f"There is no intact checkpoint to resume from in {root}: {reasons}.",
            "Restore the checkpoint folder from a copy, or train again as a new run (gemctl "
            "submit without --resume). The run's record is left as it was.")
    return point
