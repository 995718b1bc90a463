"""What a dataset directory holds, written beside its Parquet shards as meta.json.

The model is sized from it (vocabularies, feature names, dense width), so a recipe never
repeats what the data already knows. A meta.json is read through ``parse_meta``, which checks
every field's type and range: a hand-edited or foreign file is a ``DataError`` naming the field,
never a crash later in training.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from gem_platform.errors import DataError
from gem_platform.json_results import write_json

META_FILE = "meta.json"
# Counts and sizes stay far below int64's limit, so ``id + 1`` never overflows in numpy.
MAX_COUNT = 2**62
_FIX = ("Regenerate the dataset (meta.json is written by `gemctl data generate` or `gemctl "
        "data movielens`, not by hand) or point data.path at one of theirs.")


@dataclass(frozen=True)
class SparseFeatureSpec:
    """One non-sequence categorical feature: ids in [0, vocab_size)."""

    name: str
    vocab_size: int
    multi_hot: bool = False


@dataclass
class DatasetMeta:
    source: str  # "synthetic" or "movielens-100k" / "movielens-1m"
    num_items: int  # item ids are 1..num_items (0 = none)
    num_action_types: int
    sparse_features: list[SparseFeatureSpec]
    dense_dim: int
    num_train: int
    num_eval: int
    ctr_base_rate: float
    cvr_base_rate: float  # among clicked samples
    # AUC of the planted ground-truth scorer on the eval split (the ceiling); None for real data.
    planted_auc: dict[str, float] | None = None
    max_seq_len: int = 0
    # Items carry a category in [0, num_categories) (a small vocabulary, e.g. genres), stored
    # beside every history event and the candidate, so the model can learn history-candidate
    # affinity per category from few samples instead of per item. 0: the data has none.
    num_categories: int = 0
    extra: dict = field(default_factory=dict)

    def save(self, directory: str | Path) -> Path:
        return write_json(Path(directory) / META_FILE, asdict(self), indent=2)

    @classmethod
    def load(cls, directory: str | Path) -> DatasetMeta:
        """The checked meta.json of a local dataset directory: a DataError when it is
        malformed; OSError (missing, unreadable) for the caller to word."""
        path = Path(directory) / META_FILE
        try:
            text = path.read_bytes().decode()
        except UnicodeDecodeError as e:
            raise DataError(f"{path} is not text ({e}).", _FIX) from None
        return parse_meta_text(text, str(path))


# ----------------------------------------------------------------------------- checking

# field -> (kind, lowest allowed value); kinds: "int", "rate" (a number in [0, 1]), "text"
_SCALARS: dict[str, tuple[str, int]] = {
    "source": ("text", 0), "num_items": ("int", 1), "num_action_types": ("int", 1),
    "dense_dim": ("int", 0), "num_train": ("int", 0), "num_eval": ("int", 0),
    "ctr_base_rate": ("rate", 0), "cvr_base_rate": ("rate", 0), "max_seq_len": ("int", 0),
    "num_categories": ("int", 0),
}
_REQUIRED = ("source", "num_items", "num_action_types", "sparse_features", "dense_dim",
             "num_train", "num_eval", "ctr_base_rate", "cvr_base_rate")


def _bad(where: str, name: str, value: Any, want: str) -> DataError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return DataError(f"{where}: field {name!r} is {shown}, not {want}.", _FIX)


def is_count(value: Any, low: int = 0) -> bool:
    """A JSON whole number (not a bool) in [low, MAX_COUNT]."""
    return type(value) is int and low <= value <= MAX_COUNT


def _scalar(where: str, name: str, value: Any) -> Any:
    kind, low = _SCALARS[name]
    if kind == "int" and not is_count(value, low):
        raise _bad(where, name, value, f"a whole number >= {low}")
    if kind == "rate" and not (type(value) in (int, float) and 0.0 <= value <= 1.0):
        raise _bad(where, name, value, "a number between 0 and 1")
    if kind == "text" and not (isinstance(value, str) and value):
        raise _bad(where, name, value, "a non-empty string")
    return value


def _sparse(where: str, value: Any) -> list[SparseFeatureSpec]:
    if not isinstance(value, list):
        raise _bad(where, "sparse_features", value, "a list of features")
    specs, seen = [], set()
    for i, item in enumerate(value):
        name = f"sparse_features[{i}]"
        if not isinstance(item, dict) or set(item) - {"name", "vocab_size", "multi_hot"}:
            raise _bad(where, name, item, "{name, vocab_size, multi_hot}")
        if not isinstance(item.get("name"), str) or not item["name"] or item["name"] in seen:
            raise _bad(where, f"{name}.name", item.get("name"), "a new non-empty string")
        if not is_count(item.get("vocab_size"), 1):
            raise _bad(where, f"{name}.vocab_size", item.get("vocab_size"),
                       "a whole number >= 1")
        if type(item.get("multi_hot", False)) is not bool:
            raise _bad(where, f"{name}.multi_hot", item["multi_hot"], "true or false")
        seen.add(item["name"])
        specs.append(SparseFeatureSpec(item["name"], item["vocab_size"],
                                       item.get("multi_hot", False)))
    return specs


def _auc(where: str, value: Any) -> dict[str, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and type(v) in (int, float) for k, v in value.items()):
        raise _bad(where, "planted_auc", value, "null or a map of task to number")
    return value


def _extra(where: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise _bad(where, "extra", value, "a map")
    hist = value.get("seq_len_histogram")
    if hist is not None and not (isinstance(hist, list) and all(is_count(c) for c in hist)):
        raise _bad(where, "extra.seq_len_histogram", hist, "a list of whole numbers >= 0")
    return value


def parse_meta(raw: Any, where: str) -> DatasetMeta:
    """``raw`` (a parsed meta.json) as a DatasetMeta, or a DataError naming ``where`` and the
    first field whose type or range is wrong."""
    if not isinstance(raw, dict):
        raise DataError(f"{where} holds {type(raw).__name__}, not a dataset description.", _FIX)
    known = {f.name for f in fields(DatasetMeta)}
    unknown = sorted(str(k) for k in raw if k not in known)
    missing = [k for k in _REQUIRED if k not in raw]
    if unknown or missing:
        said = "; ".join(p for p in (f"unknown fields {unknown}" if unknown else "",
                                     f"missing fields {missing}" if missing else "") if p)
        raise DataError(f"{where} is not a dataset description ({said}).", _FIX)
    values = {k: _scalar(where, k, v) for k, v in raw.items() if k in _SCALARS}
    values["sparse_features"] = _sparse(where, raw["sparse_features"])
    values["planted_auc"] = _auc(where, raw.get("planted_auc"))
    values["extra"] = _extra(where, raw.get("extra", {}))
    return DatasetMeta(**values)


def parse_meta_text(text: str, where: str) -> DatasetMeta:
    """The DatasetMeta a meta.json's text describes (DataError naming ``where`` otherwise)."""
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, or an int of 4300+ digits
        raise DataError(f"{where} is not valid JSON ({e}).", _FIX) from None
    return parse_meta(raw, where)


__all__ = ["MAX_COUNT", "META_FILE", "DatasetMeta", "SparseFeatureSpec", "is_count",
           "parse_meta", "parse_meta_text"]
