"""Options shared by gemctl commands, spelled the same everywhere, and the help epilog every
command carries (an example and the exit codes)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from gemctl.errors import EXIT_CODES

P = TypeVar("P", str, Path, None)
NAME_MAX = 255  # bytes in one name of a path, on the filesystems a run writes to

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


def output_problem(path: str | Path, folder: bool) -> str | None:
    """Why a command could not write its output at ``path`` (a folder it creates with its
    parents, or a file in an existing folder), or None. Checked when the command line is read,
    so a long command never runs to lose its result at the end."""
    text = str(path)
    if "\x00" in text:
        return "it holds a NUL character"
    target = Path(os.path.abspath(text))
    long = [part for part in target.parts if len(os.fsencode(part)) > NAME_MAX]
    if long:
        return f"the name {long[0][:40]!r}... is longer than {NAME_MAX} bytes"
    if target.is_dir() != folder and target.exists():
        return "it is a file, not a folder" if folder else "it is a folder, not a file"
    where = target if target.is_dir() else target.parent
    if not folder and not where.exists():
        return f"its folder {where} does not exist"
    while not where.exists():
        where = where.parent
    if not where.is_dir():
        return f"{where} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as err:
        return f"nothing can be written in {where} ({err.strerror or err})"
    return None


def _checked(folder: bool):
    def check(ctx: typer.Context, param: typer.CallbackParam, value: P) -> P:
        if value is None or ctx.resilient_parsing:  # shell completion reads, never writes
            return value
        why = output_problem(value, folder)
        if why:
            raise typer.BadParameter(f"{str(value)[:200]!r}: {why}. Pass a "
                                     f"{'folder' if folder else 'file'} you can write.")
        return value

    return check


# typer.Option(callback=...) for an output folder (made with its parents) or an output file
out_folder, out_file = _checked(folder=True), _checked(folder=False)
