"""gemctl entry point: the typer app and its global options (--version, -h, shell completion).
Every command lives in a module of its own (validate, submit, profiling, data, inspect, sweep,
runs, jobs, ui, bench) whose ``register(app)`` adds it here."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer

from gemctl import (
    bench,
    data,
    inspect,
    jobs,
    profiling,
    runs,
    submit,
    sweep,
    ui,
    validate,
)
from gemctl.errors import EXIT_CODES

app = typer.Typer(
    no_args_is_help=True, add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Train GEM-style recommendation models on Ray, tracked in MLflow.",
    epilog=f"Start with: gemctl validate recipes/demo.yaml, then gemctl submit "
    f"recipes/demo.yaml --local. {EXIT_CODES}")


def _version(show: bool) -> None:
    if not show:
        return
    try:
        text = version("gem-platform")
    except PackageNotFoundError:
        text = "unknown (not installed)"
    typer.echo(f"gemctl {text}")
    raise typer.Exit(0)


@app.callback()
def root(
    show_version: Annotated[bool, typer.Option(
        "--version", "-V", callback=_version, is_eager=True,
        help="Print gemctl's version and exit.")] = False,
) -> None:
    """Train GEM-style recommendation models on Ray, tracked in MLflow."""


# Every command lives in a module of its own that adds it with register(app), in this order.
for _module in (validate, submit, profiling, data, inspect, sweep, runs, jobs, ui, bench):
    _module.register(app)


def main() -> None:
    try:
        app()
    except SystemExit as done:
        remote = sys.modules.get("gem_platform.data.remote")  # loaded only if data was read
        if remote is not None:
            remote.exit_now_if_calls_hang(done.code)  # don't wait on a hung storage request
        raise


if __name__ == "__main__":
    main()
