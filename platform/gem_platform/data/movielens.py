"""MovieLens 100K / 1M ratings turned into GEM samples (same Parquet format as synthetic data).

Every rating is one sample:

- history: the user's earlier ratings in time order (ties keep file order), capped at the
  ``max_history`` most recent; action type = the rating value 1..5 (0 is unused);
  ``seq_age`` = log1p(seconds between that rating and this one);
- candidate ad: the rated movie (item id = MovieLens movie id);
- item category (of every history movie and of the candidate): the movie's first listed
  genre, or a last "(no genre)" category for a movie without any;
- sparse features: user_id, gender, age_bucket (the 7 buckets of MovieLens 1M; 100K ages are
  bucketed the same way), occupation, zip_prefix (first two digits; 100 = not numeric),
  ad_genres (the movie's genres, multi-hot);
- dense: log1p(number of earlier ratings), log1p(seconds since the previous rating), mean of
  the earlier ratings / 5 (0 without history): all computed from the past only;
- labels: CTR = rating >= 4, CVR = rating == 5 (defined among CTR = 1).

Eval split: for each user with at least two ratings, their last
``max(1, round(eval_fraction * n))`` ratings in time (leave-last-out); everything else is
train. Rows of each split are shuffled with ``seed`` before sharding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gem_platform.data.meta import DatasetMeta, SparseFeatureSpec, is_count
from gem_platform.data.ownership import Writer
from gem_platform.errors import DataError

if TYPE_CHECKING:  # the arrays and the Parquet writer load once the input checks out
    from gem_platform.data.arrays import SampleArrays

# MovieLens 1M age codes; 100K raw ages map onto the same buckets.
AGE_BUCKETS: tuple[int, ...] = (1, 18, 25, 35, 45, 50, 56)
GENRES_100K: tuple[str, ...] = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
    "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance",
    "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
NUM_ACTION_TYPES = 6  # rating values 1..5; 0 unused
ZIP_OTHER = 100
NO_GENRE = "(no genre)"
DENSE_DIM = 3
ENCODING = "latin-1"
FILES = {
    "movielens-100k": ("u.data", "u.user", "u.item"),
    "movielens-1m": ("ratings.dat", "users.dat", "movies.dat"),
}


def _not_converted(meta: DatasetMeta) -> str | None:
    """Why ``meta`` is not one this converter wrote, or None when it is."""
    if meta.source not in FILES:
        return f"its meta.json says source {meta.source!r}"
    extra = meta.extra
    fraction = extra.get("eval_fraction")
    if not (is_count(extra.get("max_history")) and is_count(extra.get("seed"))
            and type(fraction) is float and 0.0 < fraction < 1.0):
        return "its meta.json lacks the converter's settings (max_history, eval_fraction, seed)"
    return None


MOVIELENS = Writer("the MovieLens converter", _not_converted)


@dataclass
class Ratings:
    user: np.ndarray  # int64
    item: np.ndarray  # int64
    rating: np.ndarray  # int64, 1..5
    ts: np.ndarray  # int64 seconds


@dataclass
class Users:
    """Per-user attributes indexed by user id (row 0 unused)."""

    gender: np.ndarray
    age_bucket: np.ndarray
    occupation: np.ndarray
    zip_prefix: np.ndarray
    known: np.ndarray  # bool
    num_occupations: int
    occupation_names: list[str]  # 100K only (1M uses integer codes 0..20)


@dataclass
class Movies:
    genre_offsets: np.ndarray  # (max_id+2,) int64, indexed by movie id
    genre_ids: np.ndarray
    genres: list[str]
    known: np.ndarray  # bool, indexed by movie id

    @property
    def categories(self) -> list[str]:
        """Category names: the genres, then "(no genre)"."""
        return [*self.genres, NO_GENRE]

    @property
    def category(self) -> np.ndarray:
        """(max_id+1,) int64: each movie's first listed genre, else the "(no genre)" index."""
        starts, ends = self.genre_offsets[:-1], self.genre_offsets[1:]
        out = np.full(len(starts), len(self.genres), dtype=np.int64)
        has = ends > starts
        out[has] = self.genre_ids[starts[has]]
        return out


def _bad_line(file: Path, line: int, what: str) -> DataError:
    return DataError(
        f"{file}, line {line}: {what}.",
        "Use the unmodified MovieLens 100K or 1M files (grouplens.org/datasets/movielens).",
    )


def _lines(file: Path) -> list[str]:
    if not file.is_file():
        raise DataError(
            f"{file} is missing.",
            "A MovieLens directory needs all three files of its release "
            "(100K: u.data, u.user, u.item; 1M: ratings.dat, users.dat, movies.dat).",
        )
    return file.read_text(encoding=ENCODING).splitlines()


def detect_format(src: Path) -> str:
    """``movielens-100k`` or ``movielens-1m``, from the files present in ``src``."""
    for fmt, files in FILES.items():
        if (src / files[0]).is_file():
            return fmt
    raise DataError(
        f"{src} holds neither MovieLens 100K (u.data, u.user, u.item) nor 1M "
        "(ratings.dat, users.dat, movies.dat) files.",
        "Point the converter at the unpacked ml-100k or ml-1m directory.",
    )


# ----------------------------------------------------------------------------- parsing


def _parse_ratings(file: Path, sep: str) -> tuple[Ratings, np.ndarray]:
    """The ratings and, for each, its 1-based line number (for error messages)."""
    lines = _lines(file)
    rows = []
    for i, ln in enumerate(lines, start=1):
        if not ln.strip():
            continue
        parts = ln.strip().split(sep)
        if len(parts) != 4:
            raise _bad_line(file, i, f"expected 4 fields (user, movie, rating, time), got {ln!r}")
        try:
            u, m, r, t = (int(p) for p in parts)
        except ValueError:
            raise _bad_line(file, i, f"non-integer field in {ln!r}") from None
        if not 1 <= r <= 5:
            raise _bad_line(file, i, f"rating {r} outside 1..5")
        if u < 1 or m < 1:
            raise _bad_line(file, i, f"user and movie ids start at 1, got {u} and {m}")
        rows.append((u, m, r, t, i))
    if not rows:
        raise DataError(f"{file} holds no ratings.", "Use a complete MovieLens ratings file.")
    a = np.array(rows, dtype=np.int64)
    return Ratings(user=a[:, 0], item=a[:, 1], rating=a[:, 2], ts=a[:, 3]), a[:, 4]


def _age_bucket(age: int) -> int:
    return int(np.searchsorted(AGE_BUCKETS, age, side="right") - 1) if age >= 1 else 0


def _zip_prefix(z: str) -> int:
    head = z.strip()[:2]
    return int(head) if len(head) == 2 and head.isdigit() else ZIP_OTHER


def _parse_users(file: Path, fmt: str) -> Users:
    lines = _lines(file)
    parsed = []
    # 100K names occupations; u.occupation, when present, fixes their ids (else first seen).
    listing = file.parent / "u.occupation"
    known_occ = _lines(listing) if fmt == "movielens-100k" and listing.is_file() else []
    occupations: dict[str, int] = {}
    for name in (ln.strip() for ln in known_occ):
        if name:
            occupations.setdefault(name, len(occupations))
    for i, ln in enumerate(lines, start=1):
        if not ln.strip():
            continue
        if fmt == "movielens-100k":
            parts = ln.split("|")  # id|age|gender|occupation|zip
            if len(parts) != 5:
                raise _bad_line(file, i, f"expected id|age|gender|occupation|zip, got {ln!r}")
            uid, age, gender, occ, zipc = parts
        else:
            parts = ln.split("::")  # id::gender::age::occupation::zip
            if len(parts) != 5:
                raise _bad_line(file, i, f"expected id::gender::age::occupation::zip, got {ln!r}")
            uid, gender, age, occ, zipc = parts
        try:
            uid_i, age_i = int(uid), int(age)
        except ValueError:
            raise _bad_line(file, i, f"non-integer user id or age in {ln!r}") from None
        if gender not in ("M", "F"):
            raise _bad_line(file, i, f"gender {gender!r} is not M or F")
        if fmt == "movielens-1m":
            try:
                occ_i = int(occ)
            except ValueError:
                raise _bad_line(file, i, f"occupation {occ!r} is not an integer code") from None
        else:
            occ_i = occupations.setdefault(occ.strip(), len(occupations))
        parsed.append((uid_i, int(gender == "F"), _age_bucket(age_i), occ_i, _zip_prefix(zipc)))
    if not parsed:
        raise DataError(f"{file} holds no users.", "Use a complete MovieLens users file.")
    a = np.array(parsed, dtype=np.int64)
    n = int(a[:, 0].max()) + 1
    cols = [np.zeros(n, dtype=np.int64) for _ in range(4)]
    for c in range(4):
        cols[c][a[:, 0]] = a[:, c + 1]
    known = np.zeros(n, dtype=bool)
    known[a[:, 0]] = True
    num_occ = len(occupations) if fmt == "movielens-100k" else max(21, int(a[:, 3].max()) + 1)
    names = list(occupations) if fmt == "movielens-100k" else []
    return Users(*cols, known=known, num_occupations=num_occ, occupation_names=names)


def _parse_movies(file: Path, fmt: str) -> Movies:
    lines = _lines(file)
    by_id: dict[int, list[str]] = {}
    names: list[str]
    for i, ln in enumerate(lines, start=1):
        if not ln.strip():
            continue
        if fmt == "movielens-100k":
            parts = ln.split("|")  # id|title|release|video release|url|19 genre flags
            if len(parts) != 5 + len(GENRES_100K):
                raise _bad_line(file, i, f"expected {5 + len(GENRES_100K)} '|' fields")
            flags = parts[5:]
            if any(f not in ("0", "1") for f in flags):
                raise _bad_line(file, i, "genre flags must be 0 or 1")
            genres = [g for g, f in zip(GENRES_100K, flags, strict=True) if f == "1"]
        else:
            head, sep, genre_field = ln.rpartition("::")  # id::title::Genre|Genre
            mid, sep2, _title = head.partition("::")
            if not sep or not sep2:
                raise _bad_line(file, i, f"expected id::title::genres, got {ln!r}")
            genres = [g for g in genre_field.split("|") if g]
            parts = [mid]
        try:
            movie_id = int(parts[0])
        except ValueError:
            raise _bad_line(file, i, f"movie id {parts[0]!r} is not an integer") from None
        by_id[movie_id] = genres
    if not by_id:
        raise DataError(f"{file} holds no movies.", "Use a complete MovieLens movies file.")
    if fmt == "movielens-100k":
        names = list(GENRES_100K)
    else:
        names = sorted({g for gs in by_id.values() for g in gs})
    index = {g: k for k, g in enumerate(names)}
    n = max(by_id) + 1
    counts = np.zeros(n, dtype=np.int64)
    ids: list[int] = []
    for mid in sorted(by_id):
        counts[mid] = len(by_id[mid])
    for mid in range(n):
        ids.extend(index[g] for g in by_id.get(mid, ()))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    known = np.zeros(n, dtype=bool)
    known[list(by_id)] = True
    return Movies(offsets, np.array(ids, dtype=np.int64), names, known)


# ----------------------------------------------------------------------------- samples


def _first_unknown(ids: np.ndarray, known: np.ndarray) -> int | None:
    """Index of the first id that is not marked known (or is past the table), else None."""
    inside = ids < len(known)
    bad = np.flatnonzero(~inside | ~known[np.where(inside, ids, 0)])
    return int(bad[0]) if bad.size else None


def _check_references(
    r: Ratings, lines: np.ndarray, users: Users, movies: Movies, file: Path
) -> None:
    k = _first_unknown(r.user, users.known)
    if k is not None:
        raise _bad_line(file, int(lines[k]), f"user {r.user[k]} is not in the users file")
    k = _first_unknown(r.item, movies.known)
    if k is not None:
        raise _bad_line(file, int(lines[k]), f"movie {r.item[k]} is not in the movies file")


def _samples(
    rows: np.ndarray,
    r: Ratings,
    user_start: np.ndarray,
    users: Users,
    movies: Movies,
    dense: np.ndarray,
    max_history: int,
) -> SampleArrays:
    """Samples for the time-sorted rating positions ``rows`` (histories from earlier rows)."""
    from gem_platform.data.arrays import SampleArrays, gather_jagged

    n = len(rows)
    lengths = np.minimum(rows - user_start[rows], max_history)
    hist_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=hist_off[1:])
    owner = np.repeat(np.arange(n), lengths)
    pos = np.arange(int(hist_off[-1])) - hist_off[owner] + (rows - lengths)[owner]
    age = (r.ts[rows][owner] - r.ts[pos]).astype(np.float64)
    u = r.user[rows]
    g_off, g_pos = gather_jagged(movies.genre_offsets, r.item[rows])
    category = movies.category
    single = np.arange(n + 1, dtype=np.int64)
    return SampleArrays(
        seq_offsets=hist_off,
        seq_item_ids=r.item[pos],
        seq_action_types=r.rating[pos],
        seq_age=np.log1p(np.maximum(age, 0.0)).astype(np.float32),
        ad_item_id=r.item[rows],
        sparse_values={
            "user_id": u,
            "gender": users.gender[u],
            "age_bucket": users.age_bucket[u],
            "occupation": users.occupation[u],
            "zip_prefix": users.zip_prefix[u],
            "ad_genres": movies.genre_ids[g_pos],
        },
        sparse_offsets={
            "user_id": single,
            "gender": single,
            "age_bucket": single,
            "occupation": single,
            "zip_prefix": single,
            "ad_genres": g_off,
        },
        dense=dense[rows],
        ctr=(r.rating[rows] >= 4).astype(np.int8),
        cvr=(r.rating[rows] == 5).astype(np.int8),
        seq_item_categories=category[r.item[pos]],
        ad_category=category[r.item[rows]],
    )


def _past_only_dense(r: Ratings, user_start: np.ndarray) -> np.ndarray:
    """Per sorted rating: log1p(#earlier), log1p(seconds since previous), mean earlier / 5."""
    n = len(r.user)
    k = np.arange(n) - user_start
    prev_gap = np.zeros(n)
    has_prev = k > 0
    prev_gap[has_prev] = (r.ts[1:] - r.ts[:-1])[has_prev[1:]]
    csum = np.concatenate([[0], np.cumsum(r.rating)])
    earlier_sum = csum[np.arange(n)] - csum[user_start]
    mean_prev = np.where(has_prev, earlier_sum / np.maximum(k, 1) / 5.0, 0.0)
    return np.stack([np.log1p(k), np.log1p(np.maximum(prev_gap, 0.0)), mean_prev], axis=1).astype(
        np.float32
    )


def _eval_mask(user_start: np.ndarray, user_count: np.ndarray, eval_fraction: float) -> np.ndarray:
    n = len(user_start)
    k = np.arange(n) - user_start
    n_eval = np.where(
        user_count >= 2,
        np.clip(np.rint(eval_fraction * user_count), 1, user_count - 1),
        0,
    )
    return k >= user_count - n_eval


@dataclass
class _Timeline:
    """Ratings sorted by (user, time, file order) with each one's user block."""

    ratings: Ratings
    user_start: np.ndarray  # index of the user's first rating, per rating
    user_count: np.ndarray  # the user's number of ratings, per rating


def _check_args(src: str, eval_fraction: float, max_history: int, rows_per_shard: int) -> Path:
    if not 0.0 < eval_fraction < 1.0:
        raise DataError(
            f"eval_fraction={eval_fraction} is outside (0, 1).",
            "Pass e.g. 0.1 to hold out each user's last 10% of ratings.",
        )
    if max_history < 0 or rows_per_shard < 1:
        raise DataError(
            f"max_history={max_history} and rows_per_shard={rows_per_shard} must be >= 0 and >= 1.",
            "Pass non-negative sizes.",
        )
    src_dir = Path(src)
    if not src_dir.is_dir():
        raise DataError(
            f"MovieLens directory {src!r} does not exist.",
            "Download and unpack ml-100k or ml-1m and pass its directory.",
        )
    return src_dir


def _read_release(src_dir: Path) -> tuple[str, Ratings, np.ndarray, Users, Movies]:
    """The release's format, ratings (with their line numbers), users and movies, checked
    against each other."""
    fmt = detect_format(src_dir)
    ratings_file, users_file, movies_file = (src_dir / f for f in FILES[fmt])
    ratings, lines = _parse_ratings(ratings_file, "\t" if fmt == "movielens-100k" else "::")
    users = _parse_users(users_file, fmt)
    movies = _parse_movies(movies_file, fmt)
    _check_references(ratings, lines, users, movies, ratings_file)
    return fmt, ratings, lines, users, movies


def _timeline(ratings: Ratings) -> _Timeline:
    order = np.lexsort((np.arange(len(ratings.user)), ratings.ts, ratings.user))
    r = Ratings(ratings.user[order], ratings.item[order], ratings.rating[order], ratings.ts[order])
    first = np.flatnonzero(np.concatenate([[True], r.user[1:] != r.user[:-1]]))
    counts = np.diff(np.concatenate([first, [len(r.user)]]))
    return _Timeline(r, np.repeat(first, counts), np.repeat(counts, counts))


def _sparse_specs(users: Users, movies: Movies) -> list[SparseFeatureSpec]:
    return [
        SparseFeatureSpec("user_id", len(users.known)),
        SparseFeatureSpec("gender", 2),
        SparseFeatureSpec("age_bucket", len(AGE_BUCKETS)),
        SparseFeatureSpec("occupation", users.num_occupations),
        SparseFeatureSpec("zip_prefix", ZIP_OTHER + 1),
        SparseFeatureSpec("ad_genres", len(movies.genres), multi_hot=True),
    ]


@dataclass
class _SplitStats:
    clicks: int = 0
    conversions: int = 0
    max_len: int = 0
    lengths: np.ndarray | None = None  # samples per history length

    def add(self, arrays: SampleArrays) -> None:
        self.clicks += int(arrays.ctr.sum())
        self.conversions += int(arrays.cvr.sum())
        lengths = arrays.seq_lengths
        self.max_len = max(self.max_len, int(lengths.max(initial=0)))
        counts = np.bincount(lengths, minlength=1)
        if self.lengths is None:
            self.lengths = counts
        else:
            size = max(self.lengths.size, counts.size)
            self.lengths = np.pad(self.lengths, (0, size - self.lengths.size)) + np.pad(
                counts, (0, size - counts.size))


def _write_splits(out: Path, split_rows: dict[str, np.ndarray], t: _Timeline, users: Users,
                  movies: Movies, dense: np.ndarray, specs: list[SparseFeatureSpec],
                  max_history: int, rows_per_shard: int) -> dict[str, _SplitStats]:
    """Every split's shards in ``out``; click, conversion and length counts per split."""
    from gem_platform.data.shards import shard_name, write_shard

    stats = {}
    for split, rows in split_rows.items():
        st = _SplitStats()
        for i, start in enumerate(range(0, max(len(rows), 1), rows_per_shard)):
            chunk = rows[start : start + rows_per_shard]
            arrays = _samples(chunk, t.ratings, t.user_start, users, movies, dense, max_history)
            write_shard(out / shard_name(split, i), arrays, specs)
            st.add(arrays)
        stats[split] = st
    return stats


def convert_movielens(
    src: str,
    out: str,
    *,
    eval_fraction: float = 0.1,
    max_history: int = 256,
    seed: int = 0,
    rows_per_shard: int = 50_000,
) -> DatasetMeta:
    """Convert a MovieLens 100K or 1M directory ``src`` into a dataset directory ``out``.

    The format is detected from the files present. ``out`` is written through a staging
    folder beside it and replaces a dataset there only if this converter wrote it
    (ownership.py); anything else there is refused.
    """
    src_dir = _check_args(src, eval_fraction, max_history, rows_per_shard)
    fmt, ratings, _, users, movies = _read_release(src_dir)
    t = _timeline(ratings)
    dense = _past_only_dense(t.ratings, t.user_start)
    is_eval = _eval_mask(t.user_start, t.user_count, eval_fraction)
    specs = _sparse_specs(users, movies)
    rng = np.random.default_rng(seed)
    split_rows = {
        s: rng.permutation(np.flatnonzero(m)) for s, m in (("train", ~is_eval), ("eval", is_eval))
    }
    from gem_platform.data.staging import os_errors, staged_dataset

    with os_errors("output folder", Path(out)), \
            staged_dataset(out, "output folder", MOVIELENS) as tmp:
        stats = _write_splits(tmp, split_rows, t, users, movies, dense, specs, max_history,
                              rows_per_shard)
        n_train = len(split_rows["train"])
        train = stats["train"]
        meta = DatasetMeta(
            source=fmt,
            num_items=len(movies.known) - 1,
            num_action_types=NUM_ACTION_TYPES,
            sparse_features=specs,
            dense_dim=DENSE_DIM,
            num_train=n_train,
            num_eval=len(split_rows["eval"]),
            ctr_base_rate=train.clicks / max(n_train, 1),
            cvr_base_rate=train.conversions / max(train.clicks, 1),
            planted_auc=None,
            max_seq_len=max(s.max_len for s in stats.values()),
            num_categories=len(movies.categories),
            extra={
                "genres": movies.genres,
                "categories": movies.categories,
                "occupations": users.occupation_names,
                "max_history": max_history,
                "eval_fraction": eval_fraction,
                "eval_split": "each user's last ratings in time (users with >= 2 ratings)",
                "seed": seed,
                "action_types": "rating value 1..5 (0 unused)",
                "dense": [
                    "log1p_num_earlier",
                    "log1p_seconds_since_previous",
                    "mean_earlier_rating_over_5",
                ],
                "num_users": int(users.known.sum()),
                "num_ratings": len(t.ratings.user),
                # train samples per history length: every rank's expected work per batch
                "seq_len_histogram": (train.lengths.tolist() if train.lengths is not None
                                      else [0]),
            },
        )
        meta.save(tmp)
    return meta
