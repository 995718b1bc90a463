"""User text in rich markup prints as written: brackets, tags and backslashes alike."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st
from rich.markup import render

from gem_platform.markup import escape_text

# backslashes, brackets and tag-like text, where rich's own escape loses a backslash
TRICKY = st.text(st.sampled_from(list("\\[]/ab#@ x")), min_size=1, max_size=10)


@settings(max_examples=400, deadline=None)
@given(TRICKY)
@example("\\[")
@example("a\\[b")
@example("\\[bold]")
@example("[/]")
def test_escaped_text_renders_as_written(text):
    if text.endswith("\\"):
        # before a closing tag the text's last backslash must not escape it
        assert render(f"[bold]{escape_text(text)}[/]").plain == text
    else:
        assert render(escape_text(text)).plain == text
        assert render(f"[bold]{escape_text(text)}[/] tail").plain == f"{text} tail"
