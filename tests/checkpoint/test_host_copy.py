"""A restarted Ray Train run's ranks on one host read the checkpoint from one local copy that
no rank rewrites while another reads it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ray.train import Checkpoint

from gem_platform.checkpoint.store import host_copy


@pytest.fixture
def checkpoint(tmp_path: Path) -> Checkpoint:
    src = tmp_path / "saved"
    src.mkdir()
    (src / "rank0.pt").write_bytes(os.urandom(1 << 20))
    (src / "gem_step.json").write_text('{"step": 3}')
    return Checkpoint.from_directory(str(src))


def _stat(folder: str | Path) -> tuple[int, int]:
    st = os.stat(Path(folder) / "rank0.pt")
    return st.st_ino, st.st_mtime_ns


def test_rays_own_copy_is_rewritten_in_place_by_a_later_caller(checkpoint):
    """What host_copy guards against: a second to_directory() on the host, after the first
    finished, writes the same files again where a first reader may still be reading."""
    first = checkpoint.to_directory()
    before = _stat(first)
    second = checkpoint.to_directory()
    assert second == first
    inode, mtime = _stat(second)
    assert inode == before[0] and mtime != before[1]


def test_a_later_caller_reuses_the_copy_untouched(checkpoint, tmp_path):
    first = host_copy(checkpoint)
    before = _stat(first)
    assert host_copy(checkpoint) == first
    assert _stat(first) == before
    src = Path(checkpoint.path)
    assert (first / "rank0.pt").read_bytes() == (src / "rank0.pt").read_bytes()
    assert sorted(p.name for p in first.iterdir()) == ["gem_step.json", "rank0.pt"]


def test_a_copy_a_killed_process_left_is_made_again(checkpoint):
    folder = host_copy(checkpoint)
    Path(f"{folder}.copied").unlink()  # as if the copying process died before finishing
    (folder / "rank0.pt").write_bytes(b"torn")
    assert host_copy(checkpoint) == folder
    assert (folder / "rank0.pt").read_bytes() == (Path(checkpoint.path) / "rank0.pt").read_bytes()
