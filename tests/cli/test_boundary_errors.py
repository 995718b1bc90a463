"""User errors that once ended in a traceback with exit code 1 now end in one paragraph naming
the problem and the fix, exit code 2: deeply nested YAML, a database URI whose driver is not
installed, a malformed URI, a sweep whose base is not a recipe, a path the filesystem can't
take, a working folder that can't be written."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.cli.conftest import REPO, clean_exit

DEMO = str(REPO / "recipes" / "demo.yaml")
# A URI refused before anything runs: about a second on a quiet machine (the first case imports
# MLflow), several on a loaded 2-core CI machine; a URI refused late would first generate the
# demo's 200,000 samples (which the gem_data check below catches too).
REFUSED_S = 15.0


def paragraph(result) -> str:
    text = " ".join(result.stderr.split())
    assert text.startswith("error: ") and text.count("error: ") == 1, text
    return text


@pytest.mark.parametrize("text", ["a: " + "[" * 5000 + "]" * 5000,
                                  "a: " + "{b: " * 3000 + "1" + "}" * 3000,
                                  "a:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 200))])
def test_deeply_nested_yaml(gemctl, tmp_path, text):
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    result = gemctl("validate", str(path))
    clean_exit(result, 2)
    assert "nests deeper than 64 levels" in paragraph(result)
    result = gemctl("validate", DEMO, "--set", "model.attention=" + "[" * 3000)
    clean_exit(result, 2)


@pytest.mark.parametrize("uri, needle", [
    ("postgresql://u:secret@127.0.0.1/db", "driver 'psycopg'"),
    ("mysql://u:secret@127.0.0.1/db", "driver 'MySQLdb'"),
    ("postgresql+nodriver://u:secret@127.0.0.1/db", "not a database URI"),
    ("http://[::1", "is malformed"),
    ("http://u:secret@host:99999", "is malformed"),
    ("sqlite:///a\x00b.db", "control character"),
    ("gopher://u:secret@127.0.0.1/x", "no tracking store for gopher://"),
])
def test_tracking_uris_that_cannot_work(gemctl, tmp_path, monkeypatch, uri, needle):
    """Refused before any data is prepared or run is opened, the password masked."""
    monkeypatch.chdir(tmp_path)
    for args in (["runs"], ["submit", DEMO, "--local"]):
        start = time.perf_counter()
        result = gemctl(*args, "--tracking-uri", uri)
        clean_exit(result, 2)
        text = paragraph(result)
        assert needle in text and "secret" not in text
        assert time.perf_counter() - start < REFUSED_S
    assert not (tmp_path / "gem_data").exists()


@pytest.mark.parametrize("address", ["ray://[::1", "ray://h:99999", "http://[::1",
                                     "http://h:port", "ray://a\x07b:1"])
def test_malformed_addresses(gemctl, address):
    result = gemctl("submit", DEMO, "--address", address)
    clean_exit(result, 2)
    assert "address" in paragraph(result).lower()


@pytest.mark.parametrize("base, needle", [
    ("list.yaml", "is a YAML list, not a recipe"),
    ("spec.yaml", "is a sweep spec, not a recipe"),
    ("x" * 300 + ".yaml", "is not a usable path"),
    ("a\x00b.yaml", "is not a usable path"),
    (".", "does not exist"),
])
def test_sweep_base_that_is_not_a_recipe(gemctl, tmp_path, base, needle):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "spec.yaml").write_text(json.dumps({"name": "s", "base": base,
                                                   "arms": {"a": []}}))
    for command in (["validate"], ["sweep", "--in-process"]):
        result = gemctl(*command, str(tmp_path / "spec.yaml"))
        clean_exit(result, 2)
        assert needle in paragraph(result)


@pytest.mark.parametrize("path", ["x" * 300 + ".yaml", "d/" * 2100 + "r.yaml", "a\x00b.yaml"])
def test_recipe_paths_the_filesystem_cannot_take(gemctl, path):
    for command in ("validate", "plan", "submit"):
        result = gemctl(command, path)
        clean_exit(result, 2)
        if "\x00" in path:  # the argument parser refuses it, with its usage line
            assert "embedded null byte" in result.stderr
        else:
            assert "can't be used" in paragraph(result)


def test_results_paths_and_bytes(gemctl, tmp_path):
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    for name in ("bin.json", "deep.json", "x" * 300 + ".json", "a\x00b.json"):
        result = gemctl("compare", str(tmp_path / name), "--no-plot")
        clean_exit(result, 2)
        assert "Cannot read sweep results" in paragraph(result)


def test_a_working_folder_that_cannot_be_written(gemctl, monkeypatch):
    """/sys refuses new entries even to root: the log folder can't be made."""
    monkeypatch.chdir("/sys")
    result = gemctl("submit", DEMO, "--local", "--tracking-uri", "sqlite:////tmp/x.db")
    clean_exit(result, 2)
    text = paragraph(result)
    assert "gem_runs" in text and "folder you can write" in text


def test_plan_out_in_a_missing_folder(gemctl, tmp_path):
    """Refused when the command line is read, before the plan is computed."""
    result = gemctl("plan", DEMO, "--out", str(tmp_path / "no" / "plan.json"))
    clean_exit(result, 2)
    text = " ".join(result.stderr.replace("\u2502", " ").split())
    assert "Invalid value for '--out'" in text and "does not exist" in text, text
    assert not Path(tmp_path / "no").exists()
