"""Generation and conversion replace only a folder their own writer made: a folder holding
anything else (a foreign meta.json, a converted dataset, a file of the user's) is refused with
the folder, the reason and the fix, and nothing in it is touched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gem_platform.data.movielens import convert_movielens
from gem_platform.data.synthetic import generate_synthetic
from gem_platform.errors import DataError
from tests.data.conftest import refused
from tests.data.test_movielens import write_100k

REPO = Path(__file__).resolve().parents[2]
FIX = "Choose another"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def converted(tmp_path) -> Path:
    """A converted MovieLens dataset."""
    out = tmp_path / "movielens"
    convert_movielens(str(write_100k(tmp_path / "ml-100k")), str(out))
    return out


def _refuses(make, folder: Path, *needles: str) -> None:
    before = _snapshot(folder)
    with pytest.raises(DataError) as err:
        make()
    text = f"{err.value.problem} {err.value.fix}"
    for needle in (str(folder), FIX, *needles):
        assert needle in text, (needle, text)
    assert _snapshot(folder) == before


def test_a_foreign_meta_json_is_not_replaced(make_config, tmp_path) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "meta.json").write_text('{"not": "meta"}')
    _refuses(lambda: generate_synthetic(make_config(folder)), folder,
             "holds a meta.json that the synthetic generator did not write")
    (folder / "mine.txt").write_text("keep me")
    _refuses(lambda: generate_synthetic(make_config(folder), force=True), folder, "mine.txt")


def test_a_converted_dataset_is_not_overwritten_by_synthetic_data(make_config,
                                                                  converted) -> None:
    _refuses(lambda: generate_synthetic(make_config(converted)), converted,
             "source 'movielens-100k'")
    (converted / "notes.md").write_text("my notes")
    _refuses(lambda: generate_synthetic(make_config(converted)), converted)


def test_a_file_of_the_users_beside_a_generated_dataset_is_kept(make_config, tmp_path) -> None:
    folder = tmp_path / "ds"
    meta = generate_synthetic(make_config(folder))
    (folder / "notes.txt").write_text("mine")
    assert generate_synthetic(make_config(folder)) == meta  # current: reused, nothing removed
    _refuses(lambda: generate_synthetic(make_config(folder, seed=5)), folder, "notes.txt")
    _refuses(lambda: generate_synthetic(make_config(folder), force=True), folder, "notes.txt")
    assert (folder / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("extra", [{}, {"config_hash": "v3-0123456789abcdef"},
                                   {"config_hash": 7, "generator_version": 3},
                                   {"config_hash": "v2-0123456789abcdef", "generator_version": 3},
                                   {"config_hash": "v3-xyz", "generator_version": 3}])
def test_synthetic_meta_without_our_fingerprint_is_not_replaced(make_config, tmp_path, hand,
                                                                extra) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    meta = hand.meta(7)
    meta.extra = extra
    meta.save(folder)
    _refuses(lambda: generate_synthetic(make_config(folder)), folder, "fingerprint")


def test_a_file_or_a_link_at_the_path_is_not_replaced(make_config, tmp_path) -> None:
    target = tmp_path / "real"
    generate_synthetic(make_config(target))
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(DataError, match="symbolic link"):
        generate_synthetic(make_config(link, seed=3))
    assert link.is_symlink()
    plain = tmp_path / "plain"
    plain.write_text("x")
    with pytest.raises(DataError, match="is a file"):
        generate_synthetic(make_config(plain))
    assert plain.read_text() == "x"


def test_new_empty_and_own_folders_are_written(make_config, tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert generate_synthetic(make_config(empty)).num_train > 0
    first = generate_synthetic(make_config(tmp_path / "new" / "ds"))
    again = generate_synthetic(make_config(tmp_path / "new" / "ds", seed=4))
    assert again.extra["config_hash"] != first.extra["config_hash"]


def test_conversion_replaces_only_its_own_output(tmp_path, converted, make_config) -> None:
    src = str(tmp_path / "ml-100k")
    assert convert_movielens(src, str(converted), eval_fraction=0.5).num_eval == 3
    synthetic = tmp_path / "syn"
    generate_synthetic(make_config(synthetic))
    _refuses(lambda: convert_movielens(src, str(synthetic)), synthetic, "source 'synthetic'")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "meta.json").write_text(json.dumps({"not": "meta"}))
    _refuses(lambda: convert_movielens(src, str(foreign)), foreign)
    (converted / "mine.txt").write_text("keep")
    _refuses(lambda: convert_movielens(src, str(converted)), converted, "mine.txt")


def test_the_cli_refuses_with_exit_2(gemctl, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "meta.json").write_text('{"not": "meta"}')
    result = gemctl("data", "generate", str(REPO / "recipes/demo.yaml"), "--set",
                    f"data.path={folder}", "--set", "data.synthetic.num_samples=300")
    refused(result, str(folder), FIX)
    result = gemctl("data", "generate", str(REPO / "recipes/demo.yaml"), "--force", "--set",
                    f"data.path={folder}", "--set", "data.synthetic.num_samples=300")
    refused(result, str(folder), FIX)
    result = gemctl("data", "movielens", str(write_100k(tmp_path / "ml")), "--out", str(folder))
    refused(result, str(folder), FIX)
    assert _snapshot(folder) == {"meta.json": b'{"not": "meta"}'}


def test_files_the_platform_keeps_beside_a_dataset_do_not_block_regeneration(make_config,
                                                                            tmp_path) -> None:
    """The linear reference's cache (and a temporary file of it) is the platform's own; a JSON
    file of the user's is not, whatever its name."""
    from gem_platform.reference.cache import REFERENCE_FILE, LinearReference

    folder = tmp_path / "ds"
    generate_synthetic(make_config(folder))
    ref = LinearReference(version=1, dataset_digest="abc", tasks={}, train_samples=1,
                          num_features=1, fit_s=0.1)
    (folder / REFERENCE_FILE).write_text(ref.to_json())
    (folder / f".{REFERENCE_FILE}.tmp-123").write_text("{")
    assert generate_synthetic(make_config(folder, seed=9)).extra["seed"] == 9
    assert not (folder / REFERENCE_FILE).exists()  # it described the replaced dataset
    (folder / "results.json").write_text(json.dumps({"kind": "mine"}))
    _refuses(lambda: generate_synthetic(make_config(folder, seed=10)), folder, "results.json")


def test_submit_refuses_a_folder_it_did_not_write(gemctl, tmp_path, monkeypatch,
                                                  converted) -> None:
    """A recipe whose data.path is a converted MovieLens folder (with a file of the user's
    beside it) or a folder whose meta.json is not ours: submit exits 2 before any run opens,
    and every byte there is kept."""
    monkeypatch.chdir(tmp_path)
    (converted / "notes.md").write_text("my notes")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "meta.json").write_text('{"not": "meta"}')
    for folder, reason in ((converted, "holds notes.md, which the synthetic generator did "
                                       "not write"),
                           (foreign, "holds a meta.json that the synthetic generator did not "
                                     "write")):
        before = _snapshot(folder)
        result = gemctl("submit", str(REPO / "recipes/demo.yaml"), "--local",
                        "--set", f"data.path={folder}",
                        "--set", "data.synthetic.num_samples=300")
        refused(result, f"data.path {str(folder)!r} {reason}", FIX, "nothing was written")
        assert _snapshot(folder) == before
    runs = tmp_path / "gem_runs"
    assert not runs.exists() or {p.name for p in runs.iterdir()} <= {"logs"}, "a run opened"


def test_a_folder_that_is_no_dataset_is_never_offered_for_removal(make_config, tmp_path) -> None:
    """data.path pointing at a working folder ('.', '/', a project) or at a file: the fix
    names another data.path and never suggests removing what is there."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "README.md").write_text("mine")
    plain = tmp_path / "notes.txt"
    plain.write_text("mine")
    for target in (project, plain):
        with pytest.raises(DataError) as err:
            generate_synthetic(make_config(target))
        assert str(target) in err.value.problem
        assert "Choose another data.path" in err.value.fix
        assert "remove" not in err.value.fix, err.value.fix
    assert (project / "README.md").read_text() == "mine" and plain.read_text() == "mine"


def test_a_shard_the_generator_did_not_list_is_not_deleted(make_config, tmp_path) -> None:
    """A shard named like ours but beyond the counts meta.json records (copied in from another
    dataset) is not the generator's: regeneration is refused and the shard kept."""
    folder = tmp_path / "ds"
    meta = generate_synthetic(make_config(folder))
    copied = folder / "train-00042.parquet"
    copied.write_bytes((folder / "train-00000.parquet").read_bytes())
    assert generate_synthetic(make_config(folder)) == meta  # current: reused as it is
    _refuses(lambda: generate_synthetic(make_config(folder, seed=5)), folder,
             "holds train-00042.parquet, which its meta.json does not list")
    assert copied.is_file()
