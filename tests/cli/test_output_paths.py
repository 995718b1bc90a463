"""Where a command writes its result (--out, --trace) is checked when the command line is read:
a path nothing can be written to is refused at once with exit code 2, naming the option, the
path and why, instead of after a benchmark, a profile or a conversion has run to its end
(`gemctl bench bbs --out /proc/x` ran for minutes, then failed). Nothing is created."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gemctl.options import output_problem
from tests.cli.conftest import REPO, clean_exit

DEMO = str(REPO / "recipes" / "demo.yaml")
# A refusal when the command line is read: well under a second on a quiet machine, more on a
# loaded 2-core CI machine; the defect ran the whole benchmark first (minutes).
AT_ONCE_S = 10.0
FOLDER_OPTIONS = [("bench", "bbs"), ("bench", "loader"), ("bench", "e2e", DEMO),
                  ("bench", "repro", DEMO), ("bench", "compile-check", DEMO),
                  ("bench", "quality", DEMO), ("bench", "terms", DEMO), ("bench", "kernels"),
                  ("profile-data", DEMO),
                  ("data", "movielens", str(REPO))]
FILE_OPTIONS = [("plan", DEMO, "--out"), ("profile", DEMO, "--out"),
                ("profile", DEMO, "--trace")]


def squeezed(text: str) -> str:
    """``text`` without the frame rich draws around an error and without any whitespace: rich
    breaks a long path inside a word, wherever the frame's width ends it."""
    return "".join(text.replace("\u2502", " ").split())


def says(result, *parts: str) -> bool:
    """The error holds every one of ``parts``, however rich broke its lines."""
    text = squeezed(result.stderr)
    return all(squeezed(part) in text for part in parts)


def unusable(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (path, the reason the message gives)."""
    (tmp_path / "a-file").write_text("the user's")
    return {"proc": ("/proc/gem-x/y", "nothing can be written in /proc"),
            "sys": ("/sys/gem-x", "nothing can be written in /sys"),
            "under_a_file": (str(tmp_path / "a-file" / "x"), "is a file, not a folder"),
            "long_name": (str(tmp_path / ("x" * 300) / "y"), "longer than 255 bytes")}


@pytest.mark.parametrize("command", FOLDER_OPTIONS, ids=lambda c: "-".join(c[:2]))
def test_output_folders_nothing_can_be_written_to(gemctl, tmp_path, command):
    for path, why in unusable(tmp_path).values():
        start = time.perf_counter()
        result = gemctl(*command, "--out", path)
        clean_exit(result, 2)
        assert says(result, "Invalid value for '--out'", why), result.stderr
        assert time.perf_counter() - start < AT_ONCE_S
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    assert (tmp_path / "a-file").read_text() == "the user's"


@pytest.mark.parametrize("command", FILE_OPTIONS, ids=lambda c: c[0] + c[2])
def test_output_files_nothing_can_be_written_to(gemctl, tmp_path, command):
    (tmp_path / "a-file").write_text("the user's")
    paths = [("/proc/x.json", "nothing can be written in /proc"),
             ("/sys/x.json", "nothing can be written in /sys"),
             (str(tmp_path / "a-file" / "x.json"), "a-file is a file, not a folder"),
             (str(tmp_path / ("x" * 300 + ".json")), "longer than 255 bytes"),
             (str(tmp_path), "is a folder, not a file"),
             (str(tmp_path / "missing" / "x.json"), "missing does not exist")]
    for path, why in paths:
        result = gemctl(*command, path)
        clean_exit(result, 2)
        assert says(result, f"Invalid value for '{command[2]}'", why), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_writable_places_pass(tmp_path):
    assert output_problem(tmp_path / "new" / "deeper", folder=True) is None
    assert output_problem(tmp_path, folder=True) is None
    assert output_problem(tmp_path / "plan.json", folder=False) is None
    (tmp_path / "plan.json").write_text("{}")  # an earlier plan: overwritten, as asked
    assert output_problem(tmp_path / "plan.json", folder=False) is None
