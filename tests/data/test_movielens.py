"""MovieLens 100K and 1M conversion on tiny files written in those formats."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from gem_platform.data.config import DataConfig
from gem_platform.data.movielens import convert_movielens
from gem_platform.data.parquet import SampleTable
from gem_platform.data.prepare import prepare_dataset
from gem_platform.errors import DataError

FLAGS = {"Action": 1, "Comedy": 5, "Drama": 8}  # positions among the 19 ML-100K genre flags


def _item_line(movie: int, title: str, genres: list[str]) -> str:
    flags = ["0"] * 19
    for g in genres:
        flags[FLAGS[g]] = "1"
    return "|".join([str(movie), title, "01-Jan-1995", "", "http://example.org"] + flags)


def write_100k(d: Path, ratings: list[tuple[int, int, int, int]] | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    ratings = ratings or [
        (1, 1, 5, 100), (1, 2, 3, 50), (1, 3, 4, 200), (1, 4, 1, 300),
        (2, 2, 4, 10), (2, 3, 5, 20),
        (3, 4, 2, 5),
    ]  # fmt: skip
    (d / "u.data").write_text("".join(f"{u}\t{m}\t{r}\t{t}\n" for u, m, r, t in ratings))
    (d / "u.user").write_text("1|24|M|technician|85711\n2|53|F|other|94043\n3|17|M|writer|T8H1N\n")
    items = [
        _item_line(1, "Toy Story (1995)", ["Comedy"]),
        _item_line(2, "GoldenEye (1995)", ["Action"]),
        _item_line(3, "Caf\u00e9 Society (1995)", ["Comedy", "Drama"]),  # latin-1 byte
        _item_line(4, "Untitled (1995)", []),
    ]
    (d / "u.item").write_bytes(("\n".join(items) + "\n").encode("latin-1"))
    return d


def write_1m(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "ratings.dat").write_text(
        "1::1193::5::978300760\n1::661::3::978302109\n1::914::3::978301968\n"
        "2::1193::4::978298413\n2::661::5::978299000\n2::914::2::978299100\n"
    )
    (d / "users.dat").write_text("1::F::1::10::48067\n2::M::56::16::70072-1234\n")
    (d / "movies.dat").write_bytes(
        "1193::One Flew Over the Cuckoo's Nest (1975)::Drama\n"
        "661::James and the Giant Peach (1996)::Animation|Children's|Musical\n"
        "914::My Fair Lady (1964)::Musical|Romance\n".encode("latin-1")
    )
    return d


def _row(table: SampleTable, user: int, movie: int) -> int:
    a = table.arrays
    hits = np.flatnonzero((a.sparse_values["user_id"] == user) & (a.ad_item_id == movie))
    assert hits.size == 1
    return int(hits[0])


def _history(table: SampleTable, row: int) -> tuple[list[int], list[int], list[float]]:
    a = table.arrays
    s, e = a.seq_offsets[row], a.seq_offsets[row + 1]
    return a.seq_item_ids[s:e].tolist(), a.seq_action_types[s:e].tolist(), a.seq_age[s:e].tolist()


def test_100k_samples_histories_labels_and_split(tmp_path: Path) -> None:
    meta = convert_movielens(str(write_100k(tmp_path / "ml")), str(tmp_path / "out"))
    assert meta.source == "movielens-100k"
    assert (meta.num_train, meta.num_eval) == (5, 2)  # each user's last rating; user 3 has one
    assert meta.num_items == 4 and meta.num_action_types == 6 and meta.planted_auc is None
    assert [s.name for s in meta.sparse_features] == [
        "user_id", "gender", "age_bucket", "occupation", "zip_prefix", "ad_genres",
    ]  # fmt: skip
    assert meta.ctr_base_rate == pytest.approx(3 / 5)  # train ratings >= 4: 5, 4, 4
    assert meta.cvr_base_rate == pytest.approx(1 / 3)

    train = SampleTable.load(tmp_path / "out", "train")
    ev = SampleTable.load(tmp_path / "out", "eval")
    assert len(train) == 5 and len(ev) == 2

    # User 1 in time order: movie 2 (t=50, r3), 1 (t=100, r5), 3 (t=200, r4), 4 (t=300, r1).
    r = _row(train, 1, 3)
    items, actions, ages = _history(train, r)
    assert items == [2, 1] and actions == [3, 5]
    assert ages == pytest.approx([math.log1p(150), math.log1p(100)])
    assert train.arrays.ctr[r] == 1 and train.arrays.cvr[r] == 0
    assert train.arrays.dense[r].tolist() == pytest.approx(
        [math.log1p(2), math.log1p(100), (3 + 5) / 2 / 5]
    )
    a = train.arrays
    g0, g1 = a.sparse_offsets["ad_genres"][r], a.sparse_offsets["ad_genres"][r + 1]
    assert sorted(a.sparse_values["ad_genres"][g0:g1].tolist()) == [FLAGS["Comedy"], FLAGS["Drama"]]
    assert a.sparse_values["zip_prefix"][r] == 85
    assert a.sparse_values["age_bucket"][r] == 1  # 24 -> bucket "18-24"

    r = _row(train, 1, 1)
    assert _history(train, r)[0] == [2] and a.ctr[r] == 1 and a.cvr[r] == 1
    r = _row(train, 3, 4)  # only rating of user 3: empty history, train split
    assert _history(train, r)[0] == []
    assert a.sparse_values["zip_prefix"][r] == 100 and a.sparse_values["age_bucket"][r] == 0
    g0, g1 = a.sparse_offsets["ad_genres"][r], a.sparse_offsets["ad_genres"][r + 1]
    assert g1 == g0  # a movie without genres

    r = _row(ev, 1, 4)
    assert _history(ev, r)[0] == [2, 1, 3] and ev.arrays.ctr[r] == 0
    assert _history(ev, _row(ev, 2, 3))[0] == [2]

    batch = train.collate(np.arange(len(train)))
    assert sorted(batch.seq_lengths.tolist()) == [0, 0, 0, 1, 2]  # users 1, 1, 1, 2, 3


def test_100k_item_category_is_the_first_genre(tmp_path: Path) -> None:
    meta = convert_movielens(str(write_100k(tmp_path / "ml")), str(tmp_path / "out"))
    assert meta.num_categories == 20 and meta.extra["categories"][-1] == "(no genre)"
    ev = SampleTable.load(tmp_path / "out", "eval")
    a = ev.arrays
    r = _row(ev, 1, 4)  # history 2 (Action), 1 (Comedy), 3 (Comedy|Drama); 4 has no genre
    s, e = a.seq_offsets[r], a.seq_offsets[r + 1]
    action, comedy = FLAGS["Action"], FLAGS["Comedy"]
    assert a.seq_item_categories[s:e].tolist() == [action, comedy, comedy]
    assert a.ad_category[r] == 19
    batch = ev.collate(np.array([r]))
    assert batch.seq_item_categories.tolist() == [1, 5, 5] and batch.ad_category.tolist() == [19]


def test_converted_directory_is_a_parquet_source(tmp_path: Path) -> None:
    meta = convert_movielens(str(write_100k(tmp_path / "ml")), str(tmp_path / "out"))
    assert prepare_dataset(DataConfig(source="parquet", path=str(tmp_path / "out"))) == meta
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "eval-00000.parquet", "meta.json", "train-00000.parquet",
    ]  # fmt: skip


def test_100k_occupation_ids_follow_u_occupation(tmp_path: Path) -> None:
    src = write_100k(tmp_path / "ml")
    (src / "u.occupation").write_text("administrator\nother\ntechnician\nwriter\n")
    meta = convert_movielens(str(src), str(tmp_path / "out"))
    assert meta.extra["occupations"] == ["administrator", "other", "technician", "writer"]
    train = SampleTable.load(tmp_path / "out", "train")
    assert train.arrays.sparse_values["occupation"][_row(train, 1, 3)] == 2
    assert train.arrays.sparse_values["occupation"][_row(train, 3, 4)] == 3


def test_max_history_keeps_the_most_recent(tmp_path: Path) -> None:
    convert_movielens(str(write_100k(tmp_path / "ml")), str(tmp_path / "out"), max_history=1)
    ev = SampleTable.load(tmp_path / "out", "eval")
    assert _history(ev, _row(ev, 1, 4))[0] == [3]


def test_eval_fraction_takes_each_users_latest(tmp_path: Path) -> None:
    meta = convert_movielens(
        str(write_100k(tmp_path / "ml")), str(tmp_path / "out"), eval_fraction=0.5
    )
    assert (meta.num_train, meta.num_eval) == (4, 3)  # user 1: 2 of 4; user 2: 1 of 2
    ev = SampleTable.load(tmp_path / "out", "eval")
    assert sorted(zip(ev.arrays.sparse_values["user_id"].tolist(), ev.arrays.ad_item_id.tolist(),
                      strict=True)) == [(1, 3), (1, 4), (2, 3)]  # fmt: skip


def test_1m_format(tmp_path: Path) -> None:
    meta = convert_movielens(str(write_1m(tmp_path / "ml")), str(tmp_path / "out"))
    assert meta.source == "movielens-1m"
    assert meta.num_items == 1193 and (meta.num_train, meta.num_eval) == (4, 2)
    assert meta.extra["genres"] == ["Animation", "Children's", "Drama", "Musical", "Romance"]
    train = SampleTable.load(tmp_path / "out", "train")
    # User 1 in time order: 1193 (r5), 914 (r3), 661 (r3, eval).
    r = _row(train, 1, 914)
    items, actions, ages = _history(train, r)
    assert items == [1193] and actions == [5]
    assert ages == pytest.approx([math.log1p(978301968 - 978300760)])
    a = train.arrays
    assert a.sparse_values["gender"][r] == 1 and a.sparse_values["age_bucket"][r] == 0
    assert a.sparse_values["occupation"][r] == 10 and a.sparse_values["zip_prefix"][r] == 48
    g0, g1 = a.sparse_offsets["ad_genres"][r], a.sparse_offsets["ad_genres"][r + 1]
    assert a.sparse_values["ad_genres"][g0:g1].tolist() == [3, 4]  # Musical, Romance
    r2 = _row(train, 2, 661)
    assert a.sparse_values["age_bucket"][r2] == 6 and a.sparse_values["zip_prefix"][r2] == 70
    ev = SampleTable.load(tmp_path / "out", "eval")
    assert _history(ev, _row(ev, 1, 661))[0] == [1193, 914]
    # Categories: the first listed genre (661 lists Animation first).
    assert meta.num_categories == 6
    r = _row(ev, 1, 661)
    s, e = ev.arrays.seq_offsets[r], ev.arrays.seq_offsets[r + 1]
    assert ev.arrays.seq_item_categories[s:e].tolist() == [2, 3]  # Drama, Musical
    assert ev.arrays.ad_category[r] == 0  # Animation


def test_same_seed_same_bytes_other_seed_other_order(tmp_path: Path) -> None:
    src = str(write_100k(tmp_path / "ml"))
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        convert_movielens(src, str(tmp_path / name), seed=seed)
    a = (tmp_path / "a" / "train-00000.parquet").read_bytes()
    assert a == (tmp_path / "b" / "train-00000.parquet").read_bytes()
    ta, tc = (SampleTable.load(tmp_path / n, "train") for n in ("a", "c"))
    assert sorted(ta.arrays.ad_item_id.tolist()) == sorted(tc.arrays.ad_item_id.tolist())
    assert ta.arrays.ad_item_id.tolist() != tc.arrays.ad_item_id.tolist()


def test_no_movielens_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="neither MovieLens 100K"):
        convert_movielens(str(tmp_path), str(tmp_path / "out"))
    with pytest.raises(DataError, match="does not exist"):
        convert_movielens(str(tmp_path / "nope"), str(tmp_path / "out"))


def test_missing_companion_file(tmp_path: Path) -> None:
    src = write_100k(tmp_path / "ml")
    (src / "u.item").unlink()
    with pytest.raises(DataError, match="u.item is missing"):
        convert_movielens(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("1\t2\tfive\t3", "non-integer"),
        ("1\t2\t6\t3", "rating 6 outside 1..5"),
        ("1\t99\t4\t3", "movie 99 is not in the movies file"),
        ("9\t1\t4\t3", "user 9 is not in the users file"),
        ("1\t2\t4", "expected 4 fields"),
    ],
)
def test_bad_rating_lines_name_file_and_line(tmp_path: Path, line: str, needle: str) -> None:
    src = write_100k(tmp_path / "ml")
    with (src / "u.data").open("a") as f:
        f.write(line + "\n")
    with pytest.raises(DataError) as err:
        convert_movielens(str(src), str(tmp_path / "out"))
    assert "u.data, line 8: " in str(err.value) and needle in str(err.value)
