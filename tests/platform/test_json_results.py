"""Results files are written by one writer, json_results.write_json: whole or not at all,
keys sorted, indented."""

from __future__ import annotations

import json

import pytest

from gem_platform.json_results import write_json
from gem_platform.sweep.results import TrialRun, write_results


def test_keys_sorted_indented_and_folder_made(tmp_path):
    path = write_json(tmp_path / "new" / "r.json", {"b": 1, "a": {"z": 2, "y": 3}})
    text = path.read_text()
    assert text == json.dumps({"a": {"y": 3, "z": 2}, "b": 1}, indent=1) + "\n"


def test_a_failed_write_leaves_the_old_file_whole(tmp_path):
    path = write_json(tmp_path / "r.json", {"figure": 1.0})
    with pytest.raises(TypeError):
        write_json(path, {"figure": 2.0, "bad": object()})
    assert json.loads(path.read_text()) == {"figure": 1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_sweep_results_go_through_it(tmp_path):
    trial = TrialRun(arm="a", seed=0, run_id="r1", metrics={"ne": 0.9})
    path = write_results(tmp_path / "results.json", {"name": "s"}, [trial])
    body = json.loads(path.read_text())
    assert list(body) == sorted(body) and body["trials"][0]["metrics"] == {"ne": 0.9}
    assert path.read_text() == json.dumps(body, indent=1, sort_keys=True) + "\n"
