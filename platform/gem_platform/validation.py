"""How a refused YAML document (a recipe, a sweep spec) is described to its user: one
paragraph that names each bad field by its dotted path and says what is allowed, quoting at
most ECHO_CHARS of any value the user gave. Recipes and sweep specs word their errors the same
way because both go through :func:`describe_invalid`."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

ECHO_CHARS = 80  # how much of a user's value an error message quotes
MAX_PROBLEMS = 10  # problems named in one message; the rest are counted
UNKNOWN_FIELD = "unknown field (check its spelling and section)"


def shorten(value: Any, limit: int = ECHO_CHARS) -> str:
    """``repr``-free text of a user's value, cut to ``limit`` characters for error messages."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_invalid(err: ValidationError, subject: str, *, root: str = "(recipe)",
                     unknown: str = UNKNOWN_FIELD) -> str:
    """"SUBJECT is invalid: PATH: PROBLEM; ...." for pydantic's ``err``. ``root`` names a
    problem of the whole document, ``unknown`` is what a misspelt or misplaced key is told."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or root
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = unknown
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {shorten(e.get('input'))})"
        lines.append(f"{shorten(loc, 120)}: {shorten(msg.rstrip('.'), 300)}")
    if len(lines) > MAX_PROBLEMS:
        lines = [*lines[:MAX_PROBLEMS], f"and {len(lines) - MAX_PROBLEMS} more"]
    return f"{subject} is invalid: " + "; ".join(lines) + "."
