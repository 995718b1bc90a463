"""The one writer of JSON results files (sweep results, benchmark and profile reports, dataset
meta): the body goes to a temporary file beside the target and is renamed over it, so a
reader, or a writer stopped halfway, never sees a partial file; keys are sorted and indented
so that two results files diff by their figures, not by the order they were filled in."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_json(path: str | Path, body: Any, *, indent: int = 1,
               default: Callable[[Any], Any] | None = None) -> Path:
    """Write ``body`` as JSON to ``path`` (its folder created) atomically; returns the path.
    ``default`` turns values json can't (numpy floats, paths) into ones it can."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(body, indent=indent, sort_keys=True, default=default) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
