"""Disk and the filesystem: a dataset that can't fit is refused before anything is written,
staging folders of killed generations are cleaned (only theirs), and a folder the system
won't let us write is one clear error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from gem_platform.data.budget import synthetic_cost
from gem_platform.data.staging import WRITER_FILE, WriterRecord, _start_ticks, os_errors
from gem_platform.data.synthetic import _mean_history, generate_synthetic
from gem_platform.errors import DataError
from tests.data.conftest import refused

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ,
       "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("platform", "kernels", ""))}


def test_a_dataset_larger_than_the_free_disk_is_refused_at_once(make_config, tmp_path) -> None:
    out = tmp_path / "ds"
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        generate_synthetic(make_config(out, num_samples=10**11))
    assert time.monotonic() - start < 5
    problem = err.value.problem
    assert "GiB of shards" in problem and "100,000,000,000 samples" in problem
    assert "GiB free" in problem and "data.synthetic.num_samples" in err.value.fix
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no folder, no staging, no lock


def test_a_dataset_too_large_for_the_disk_is_refused_before_torch_loads(tmp_path) -> None:
    """The refusal needs only the recipe and the disk: preparing data never waits for torch
    and TorchRec to load first (seconds, before the refusal of a `gemctl data generate` or a
    submit)."""
    script = (
        "import sys\nfrom gem_platform.data.config import DataConfig\n"
        "from gem_platform.data.prepare import prepare_dataset\n"
        "from gem_platform.errors import DataError\n"
        "cfg = DataConfig(path=sys.argv[1], synthetic={'num_samples': 10**11})\n"
        "try:\n    prepare_dataset(cfg)\n"
        "except DataError as err:\n    print('refused:', err.problem)\n"
        "print('loaded:', sorted(m for m in ('torch', 'torchrec') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ds")], cwd=REPO,
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert "refused: data.synthetic asks for about" in result.stdout, result.stderr
    assert "loaded: []" in result.stdout
    assert not (tmp_path / "ds").exists()


def test_a_world_larger_than_memory_is_refused_at_once(make_config, tmp_path) -> None:
    with pytest.raises(DataError, match="GiB of memory"):
        generate_synthetic(make_config(tmp_path / "ds", num_items=10**12))
    assert not (tmp_path / "ds").exists()


def test_the_disk_estimate_bounds_what_is_written(make_config, tmp_path) -> None:
    cfg = make_config(tmp_path / "ds", num_samples=6000)
    generate_synthetic(cfg)
    written = sum(p.stat().st_size for p in (tmp_path / "ds").glob("*.parquet"))
    estimate = synthetic_cost(cfg.synthetic, _mean_history(cfg.synthetic)).disk_bytes
    assert written <= estimate <= 8 * written


def _staging(tmp_path: Path, name: str, record: dict | None) -> Path:
    folder = tmp_path / f".ds.tmp-{name}"
    folder.mkdir()
    (folder / "train-00000.parquet").write_bytes(b"half")
    if record is not None:
        (folder / WRITER_FILE).write_text(json.dumps(record))
    return folder


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_staging_folders_are_removed_and_live_or_foreign_ones_kept(make_config,
                                                                         tmp_path) -> None:
    host, me = socket.gethostname(), os.getpid()
    dead = _staging(tmp_path, "dead", {"host": host, "pid": _dead_pid(), "started": None})
    reused = _staging(tmp_path, "reused", {"host": host, "pid": me,
                                           "started": (_start_ticks(me) or 0) + 1})
    alive = _staging(tmp_path, "alive", {"host": host, "pid": me, "started": _start_ticks(me)})
    remote = _staging(tmp_path, "remote", {"host": "elsewhere", "pid": _dead_pid(),
                                           "started": None})
    unknown = _staging(tmp_path, "unknown", None)
    other = tmp_path / ".other.tmp-1"  # another dataset's staging folder
    other.mkdir()
    generate_synthetic(make_config(tmp_path / "ds"))
    assert not dead.exists() and not reused.exists()
    assert alive.exists() and remote.exists() and unknown.exists() and other.exists()
    assert WriterRecord.read(alive) == WriterRecord.mine()


def test_stale_staging_of_any_dataset_is_removed_even_when_the_dataset_is_reused(
        make_config, tmp_path) -> None:
    """A generation killed while writing another dataset of the same folder (gem_data/.demo...
    while this recipe writes gem_data/ds) leaves its staging folder; the next preparation in
    that folder removes it, even one that only reuses a current dataset. Folders that record
    no writer, or a live one, are kept."""
    host = socket.gethostname()
    generate_synthetic(make_config(tmp_path / "ds"))
    dead = {"host": host, "pid": _dead_pid(), "started": None}
    mine_dead = _staging(tmp_path, "1-0123abcd", dead)
    other_dead = tmp_path / ".demo.tmp-2-89abcdef"
    other_dead.mkdir()
    (other_dead / WRITER_FILE).write_text(json.dumps(dead))
    other_alive = tmp_path / ".demo.tmp-3-00000000"
    other_alive.mkdir()
    (other_alive / WRITER_FILE).write_text(json.dumps(asdict(WriterRecord.mine())))
    unmarked = tmp_path / ".notes.tmp-mine"  # a user's folder, nothing of ours in it
    unmarked.mkdir()
    (unmarked / "keep.txt").write_text("keep")
    generate_synthetic(make_config(tmp_path / "ds"))  # current: reused, nothing written
    assert not mine_dead.exists() and not other_dead.exists()
    assert other_alive.exists() and (unmarked / "keep.txt").read_text() == "keep"


def test_the_staging_folder_of_a_killed_generation_is_removed_by_the_next(make_config,
                                                                          tmp_path) -> None:
    """A generation killed with SIGKILL while writing; the next one finds its staging folder
    (the writer is gone), removes it, and writes the dataset."""
    out = tmp_path / "ds"
    script = tmp_path / "gen.py"
    script.write_text(
        "import sys\nfrom tests.data.conftest import tiny_config\n"
        "from gem_platform.data.synthetic import generate_synthetic\n"
        "generate_synthetic(tiny_config(sys.argv[1], num_samples=400_000, rows_per_shard=500))\n")
    proc = subprocess.Popen([sys.executable, str(script), str(out)], cwd=REPO, env=ENV)
    try:
        deadline = time.monotonic() + 180
        while not list(tmp_path.glob(".ds.tmp-*/train-00000.parquet")):
            assert proc.poll() is None and time.monotonic() < deadline, "generation never began"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    [left] = tmp_path.glob(".ds.tmp-*")
    assert WriterRecord.read(left).pid == proc.pid
    generate_synthetic(make_config(out))
    assert not left.exists() and (out / "meta.json").is_file()


@pytest.mark.parametrize("parts, needle", [
    (["x" * 300], "holds the name 'xxxx"),
    (["y" * 200] * 25, "bytes long; systems take at most 4096 bytes per path"),
])
def test_a_path_longer_than_the_filesystem_allows_exits_2(gemctl, tmp_path, monkeypatch,
                                                          parts, needle) -> None:
    monkeypatch.chdir(tmp_path)
    long = tmp_path.joinpath(*parts, "ds")
    for command in ("validate", "plan", "submit", "data generate"):
        result = gemctl(*command.split(), str(REPO / "recipes/demo.yaml"), "--set",
                        f"data.path={long}")
        refused(result, "data.path", needle)
    assert sorted(tmp_path.iterdir()) == []


def test_a_name_the_system_refuses_while_writing_is_a_data_error(tmp_path) -> None:
    """What the recipe check can't see (a relative path under a deep working folder, a
    filesystem with shorter names) still ends in one message."""
    deep = tmp_path.joinpath(*["z" * 200] * 25)
    with pytest.raises(DataError) as err, os_errors("data.path", deep):
        deep.mkdir(parents=True)
    assert "can't be written: File name too long" in err.value.problem
    assert "..." in err.value.problem and len(err.value.problem) < 300
    assert "at most 255 bytes per folder or file name" in err.value.fix


def test_a_read_only_working_folder_exits_2(tmp_path) -> None:
    """The default data.path (gem_data/...) under a read-only working folder: a read-only
    mount where the test runs as root (permissions don't stop root), else a folder without
    write permission."""
    work = tmp_path / "ro"
    work.mkdir()
    command = [sys.executable, "-m", "gemctl.main", "data", "generate",
               str(REPO / "recipes/demo.yaml"), "--set", "data.synthetic.num_samples=300"]
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("needs unshare to make a read-only folder as root")
        quoted = " ".join(f"'{c}'" for c in command)
        command = ["unshare", "-rm", "sh", "-c",
                   f"mount -t tmpfs -o ro tmpfs '{work}' && cd '{work}' && exec {quoted}"]
    else:
        work.chmod(0o555)
    result = subprocess.run(command, cwd=work, env=ENV, capture_output=True, text=True,
                            timeout=300)
    if "mount:" in result.stderr or "unshare:" in result.stderr:
        pytest.skip(f"can't make a read-only mount here: {result.stderr.strip()}")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    flat = " ".join(result.stderr.split())
    assert "data.path 'gem_data/demo' can't be written" in flat, flat
    assert "writable" in flat


def test_a_small_dataset_on_a_full_filesystem_is_refused_in_readable_units(make_config) -> None:
    """procfs has no free space: the refusal gives the estimate in KiB, not '0.0 GiB'."""
    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc")
    with pytest.raises(DataError) as err:
        generate_synthetic(make_config(Path("/proc/gem-data-test"), num_samples=300))
    problem = err.value.problem
    assert "KiB of shards (300 samples" in problem and "has 0 bytes free" in problem, problem
    assert "0.0 GiB" not in problem


def test_a_replaced_dataset_left_by_a_generation_killed_while_removing_it_is_cleaned(
        make_config, tmp_path) -> None:
    """A regeneration is SIGKILLed while it deletes the dataset it replaced (a large dataset
    takes seconds to delete): the half-deleted old dataset is left beside the new one, and the
    next preparation there removes it."""
    out = tmp_path / "ds"
    generate_synthetic(make_config(out))
    syn = {k: v for k, v in make_config(out).synthetic.model_dump().items()
           if k in ("num_samples", "num_users", "num_items", "num_clusters", "seq_len",
                    "rows_per_shard")}
    script = (
        "import json, os, shutil, signal, sys\n"
        "from gem_platform.data.config import DataConfig\n"
        "from gem_platform.data.synthetic import generate_synthetic\n"
        "real = shutil.rmtree\n"
        "def rmtree(path, *a, **k):\n"
        "    if os.path.isfile(os.path.join(path, 'meta.json')):  # the replaced dataset\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(path, *a, **k)\n"
        "shutil.rmtree = rmtree\n"
        "syn = {**json.loads(sys.argv[2]), 'seed': 7}\n"
        "generate_synthetic(DataConfig(path=sys.argv[1], synthetic=syn))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(out), json.dumps(syn)], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = [p for p in tmp_path.iterdir() if p.is_dir() and p.name != "ds"]
    assert len(left) == 1 and (left[0] / "meta.json").is_file()  # the replaced dataset
    assert generate_synthetic(make_config(out, seed=7)).extra["seed"] == 7  # reused
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["ds"]
