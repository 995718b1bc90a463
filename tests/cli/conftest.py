"""The real gemctl app driven in-process (typer's CliRunner) for commands that train nothing,
and a fresh sqlite MLflow store."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gemctl.main import app

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gemctl():
    """Run ``gemctl ARGS...`` in this process; returns the click Result (stdout, stderr,
    exit_code, exception)."""
    runner = CliRunner()

    def run(*args: str):
        return runner.invoke(app, list(args), catch_exceptions=True, terminal_width=120,
                             prog_name="gemctl")

    return run


@pytest.fixture
def sqlite_uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def clean_exit(result, code: int = 0) -> None:
    """The command ended with ``code`` by itself: no exception escaped, no traceback shown."""
    assert result.exit_code == code, (result.exit_code, result.output, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output + result.stderr
