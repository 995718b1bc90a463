"""The parameter tables a dataset's sizes give the model, bounded before any is built.

The model keeps a row of model.d_model values per item (plus a padding row), per item category
and per action type, a row of model.sparse_dim values per id of each sparse feature, and a dense
projection of dense_dim x model.d_model. Those sizes come from the user (a recipe's
data.synthetic, a dataset's meta.json), so a typo can ask for a table that no cluster could
hold: torch would then fail deep inside the model's construction (its storage size overflows)
or a plan would price exabytes. A table beyond MAX_TABLE_BYTES is refused at once, naming the
field its size comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from gem_platform.data.config import SyntheticConfig
from gem_platform.data.meta import DatasetMeta
from gem_platform.errors import DataError
from gem_platform.topology.config import MAX_WORLD

PARAM_BYTES = 4  # fp32, as the tables and their optimizer state are kept
RANK_MEMORY = 128 << 30  # more memory than any accelerator of a rank has
# The memory of the largest cluster gemctl plans for (MAX_WORLD ranks of RANK_MEMORY): a
# table beyond it can't be held even sharded over every rank. Far below torch's limit on a
# tensor's bytes (2**63), so every table under it can be built on the meta device.
MAX_TABLE_BYTES = MAX_WORLD * RANK_MEMORY


@dataclass(frozen=True)
class Table:
    """One parameter table: ``rows`` set by the field ``rows_from``, ``width`` by
    ``width_from``."""

    name: str
    rows: int
    width: int
    rows_from: str
    width_from: str

    @property
    def bytes(self) -> int:
        return self.rows * self.width * PARAM_BYTES


def _tables(sizes: list[tuple[str, int, str]], d_model: int, sparse_dim: int,
            sparse: list[tuple[str, int, str]]) -> list[Table]:
    wide = [Table(name, rows, d_model, field, "model.d_model") for name, rows, field in sizes]
    return wide + [Table(f"the table of sparse feature {name!r}", rows, sparse_dim, field,
                         "model.sparse_dim") for name, rows, field in sparse]


def meta_tables(meta: DatasetMeta, d_model: int, sparse_dim: int) -> list[Table]:
    """The tables the model would build for a dataset of ``meta``'s sizes."""
    return _tables([("the item table", meta.num_items + 1, "num_items"),
                    ("the category table", meta.num_categories, "num_categories"),
                    ("the action-type table", meta.num_action_types + 1, "num_action_types"),
                    ("the dense projection", max(meta.dense_dim, 1), "dense_dim")],
                   d_model, sparse_dim,
                   [(f.name, f.vocab_size, f"sparse_features[{i}].vocab_size")
                    for i, f in enumerate(meta.sparse_features)])


def synthetic_tables(syn: SyntheticConfig, d_model: int, sparse_dim: int) -> list[Table]:
    """The tables the model would build for the synthetic dataset ``syn`` describes."""
    at = "data.synthetic."
    return _tables([("the item table", syn.num_items + 1, at + "num_items"),
                    ("the category table", syn.num_clusters, at + "num_clusters"),
                    ("the action-type table", syn.num_action_types + 1,
                     at + "num_action_types"),
                    ("the dense projection", max(syn.dense_dim, 1), at + "dense_dim")],
                   d_model, sparse_dim,
                   [("user_id", syn.num_users, at + "num_users"),
                    *((f.name, f.vocab_size, f"{at}sparse_features.{i}.vocab_size")
                      for i, f in enumerate(syn.sparse_features))])


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def oversized(tables: list[Table]) -> str | None:
    """Why the first table beyond MAX_TABLE_BYTES can't be built, in words (None: all fit)."""
    for t in tables:
        if t.bytes > MAX_TABLE_BYTES:
            return (f"{t.rows_from} makes {t.name} {t.rows:,} rows x {t.width:,} "
                    f"({t.width_from}) = {_size(t.bytes)} in fp32, more than the "
                    f"{_size(MAX_TABLE_BYTES)} that {MAX_WORLD:,} ranks of "
                    f"{_size(RANK_MEMORY)} (the largest cluster gemctl plans for) hold "
                    "together")
    return None


def check_meta_tables(meta: DatasetMeta, d_model: int, sparse_dim: int, where: str) -> None:
    """Refuse a dataset (its meta.json at ``where``) whose sizes give the model a table no
    cluster could hold, before a run is opened or the model is built."""
    why = oversized(meta_tables(meta, d_model, sparse_dim))
    if why:
        raise DataError(f"The dataset sizes of {where} can't be used: {why}.",
                        "Point data.path (or --meta) at a dataset that `gemctl data generate` "
                        "or `gemctl data movielens` wrote, not a hand-edited meta.json.")
