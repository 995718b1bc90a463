"""What an MLflow store accepts as a run's param and tag keys and tag values, checked without
importing MLflow, so that `gemctl validate` and the recipe loader refuse them in well under a
second, before any run exists.

The rules are MLflow's own (``mlflow.utils.validation``: ``_validate_tag_name``,
``_validate_param_name``, the key and value length limits, POSIX systems);
tests/platform/test_recipe_tracking_names.py holds this module to MLflow's functions on
generated keys. The driver checks again with MLflow's functions before it creates a run
(``gem_platform.tracking.check_run_inputs``).
"""

from __future__ import annotations

import posixpath
import re

MAX_KEY_CHARS = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
MAX_TAG_VALUE_CHARS = 8000  # MAX_TAG_VAL_LENGTH (longer values are cut, not refused)
_KEY_CHARS = re.compile(r"^[/\w.\- :]*$")  # validate_param_and_metric_name, off Windows
KEY_RULE = (f"MLflow keys take letters, digits and _ - . : / or space, at most {MAX_KEY_CHARS} "
            "characters")


def key_problem(key: str) -> str | None:
    """Why MLflow refuses ``key`` as a param or tag key, or None when it accepts it."""
    if not _KEY_CHARS.match(key):
        bad = sorted({ch for ch in key if not _KEY_CHARS.match(ch) or ch == "\n"})
        shown = " ".join(repr(ch) for ch in bad[:5]) or "a character"
        return f"holds {shown}, which MLflow refuses in a key"
    norm = posixpath.normpath(key)
    if norm != key or norm == "." or norm.startswith(("..", "/")):
        return f"reads as a path that resolves to {norm!r}, which MLflow refuses"
    if len(key) > MAX_KEY_CHARS:
        return f"is {len(key)} characters long; MLflow takes at most {MAX_KEY_CHARS}"
    return None


def tag_problems(tags: dict[str, str], param_prefix: str = "") -> list[str]:
    """One ``'KEY': why`` per tag MLflow would refuse: as a tag key, as a param key after
    ``param_prefix`` (recipe tags are also recorded as params), or for a value too long."""
    problems = []
    for key, value in tags.items():
        why = key_problem(key) or key_problem(param_prefix + key)
        if why is None and len(value) > MAX_TAG_VALUE_CHARS:
            why = f"has a value of {len(value)} characters; at most {MAX_TAG_VALUE_CHARS}"
        if why is not None:
            problems.append(f"{key[:60]!r} {why}")
    return problems
