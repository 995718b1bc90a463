"""Options shared by gemctl commands, spelled the same everywhere, and the help epilog every
command carries (an example and the exit codes)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gemctl.errors import EXIT_CODES

RecipeArg = Annotated[Path, typer.Argument(
    help="Recipe YAML, e.g. recipes/demo.yaml (`gemctl validate --schema` lists its fields).",
    show_default=False)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", "-s", help="Override a recipe field: --set train.steps=50 (repeatable; the value "
    "is parsed as YAML).")]
TrackingOpt = Annotated[str | None, typer.Option(
    "--tracking-uri", help="MLflow store: http://HOST:PORT or sqlite:///FILE; default "
    "tracking.uri, MLFLOW_TRACKING_URI or ./mlflow.db.")]
JsonOpt = Annotated[bool, typer.Option(
    "--json", help="Print the result as JSON on stdout (progress goes to stderr).")]
VerboseOpt = Annotated[bool, typer.Option(
    "--verbose", "-v", help="Show library output (Ray, MLflow, warnings) instead of "
    "routing it to the log file under gem_runs/logs/.")]


def epilog(*examples: str, codes: str = EXIT_CODES) -> str:
    """Help text after the options: the examples (one per line) and the exit codes."""
    lines = "\n\n".join(f"  $ {e}" for e in examples)
    return f"Examples:\n\n{lines}\n\n{codes}"
