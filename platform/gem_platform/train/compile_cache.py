"""A deterministic run's own on-disk compile cache.

Compiled regions are compiled with dynamic shapes (``train.compile``), and Inductor chooses how
to split and order a reduction over a batch's tokens from the sizes of the first batch it
compiles for. Its on-disk graph cache keys a graph by its symbolic shapes, not by those sizes,
so a process that finds a graph compiled by another recipe (another world, 4x shorter
histories) runs kernels tuned to that recipe's sizes, whose sums run in another order: the
same recipe and seed then train to other bits, depending on what the machine compiled before.
On CUDA a compiled ``silu(x @ w).sum(0)`` compiled at 1,000 rows and loaded from the shared
cache by a process running 400,000 rows differs from one compiled for 400,000 rows in its own
cache (docs/quality/README.md, "Determinism across sweeps").

``own_compile_cache(recipe, rank, compiles)`` gives a deterministic run a cache of its own: a folder
beside Inductor's default one, named by a digest of the recipe less ``train.seed`` (which
changes only the initial weights, not a batch's sizes: the data order follows
``loader.seed``) and by the rank (ranks of one run see different first batches). Trials of one
recipe at other seeds, and reruns, still reuse each other's compiled graphs. A cache folder
the user chose (``TORCHINDUCTOR_CACHE_DIR`` set to anything but Inductor's default) is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from gem_platform.recipe import Recipe

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_name(recipe: Recipe, rank: int) -> str:
    """The folder name of ``recipe``'s cache on ``rank``: equal for recipes that differ only
    in ``train.seed`` (or in where they are tracked)."""
    tree = recipe.model_dump(mode="json", exclude={"tracking"})
    tree["train"].pop("seed", None)
    digest = hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]
    return f"gem-{digest}-rank{rank}"


def _inductor_default() -> str:
    """Inductor's own default cache folder (a folder under the temp dir where this torch build
    has no Inductor)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return os.path.join(tempfile.gettempdir(), "torchinductor")
    return os.path.abspath(default_cache_dir())


def _chosen_by_user(value: str | None, default: str) -> bool:
    """Whether ``TORCHINDUCTOR_CACHE_DIR`` holds a folder the user picked. Inductor writes its
    default into the variable at its first use, so the default reads as unchosen."""
    return value is not None and os.path.abspath(value) != default


@contextmanager
def inductor_cache_at(path: str) -> Iterator[str]:
    """Inductor's cache is ``path`` for the block's duration (this process, and processes it
    starts); the variable returns to what it was on exit."""
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = before


@contextmanager
def own_compile_cache(recipe: Recipe, rank: int, compiles: bool) -> Iterator[str | None]:
    """For a deterministic run that ``compiles`` regions, point Inductor's cache at the
    recipe's own folder for the block's duration (yields it; None where the run is not
    deterministic, compiles nothing, or the user chose a folder)."""
    default = _inductor_default()
    if not (recipe.train.deterministic and compiles) or _chosen_by_user(
            os.environ.get(CACHE_ENV), default):
        yield None
        return
    with inductor_cache_at(os.path.join(default, cache_name(recipe, rank))) as path:
        yield path
