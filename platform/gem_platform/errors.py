"""User-facing errors: each names what is wrong and how to fix it. The CLI prints them as one
paragraph, without a traceback, and exits non-zero."""

from __future__ import annotations


class GemError(Exception):
    """An error caused by the user's input or environment, not by a bug in the platform.

    ``problem`` says what is wrong (naming the file, field, row or address); ``fix`` says what
    to do about it.
    """

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(problem if fix is None else f"{problem} {fix}")

    def as_text(self) -> str:
        """The paragraph a command-line entry point prints on stderr."""
        return f"error: {self.problem}" + (f"\n  fix: {self.fix}" if self.fix else "")


class RecipeError(GemError):
    """The recipe (YAML or a --set override) is malformed or inconsistent."""


class DataError(GemError):
    """A data file is missing, corrupt or holds values outside the schema."""


class ClusterError(GemError):
    """Ray, the cluster address or the requested world size can't be used."""


class TrackingError(GemError):
    """The MLflow tracking server or store can't be reached or written."""
