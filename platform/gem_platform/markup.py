"""User text inside rich markup, shown exactly as written.

rich's own ``escape`` leaves a "[" that opens no tag as it is, but rich's renderer still
takes one backslash before any "[" as an escape: ``\\[`` would print as ``[``. ``escape_text``
gives such backslashes one more, so every table and message prints user strings (run names,
paths, job commands, kernel names, error texts) as they are.
"""

from __future__ import annotations

import re

from rich.markup import escape

_TAG = re.compile(r"\[[a-z#/@][^[]*?]")
_BACKSLASHES_BEFORE_BRACKET = re.compile(r"\\+(?=\[)")


def escape_text(text: str) -> str:
    """``text`` escaped for rich markup (tags shown literally, backslashes kept). Its trailing
    backslashes are doubled: markup that follows (a closing tag) must not read them as an
    escape; at the very end of a cell they then print twice."""
    body = text.rstrip("\\")
    escaped = escape(body)

    def keep(m: re.Match[str]) -> str:
        opens_tag = _TAG.match(escaped, m.end()) is not None  # rich's escape handled these
        return m.group(0) if opens_tag else m.group(0) + "\\"

    return _BACKSLASHES_BEFORE_BRACKET.sub(keep, escaped) + "\\" * (2 * (len(text) - len(body)))
