"""gemctl runs: recent MLflow runs, newest first (the ids to pass to `gemctl compare`)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from gemctl import render
from gemctl.errors import user_errors
from gemctl.options import JsonOpt, TrackingOpt, epilog

if TYPE_CHECKING:
    from gem_platform.sweep.runs import RunRow

STATUS_STYLE = {"FINISHED": "green", "FAILED": "red", "KILLED": "yellow", "RUNNING": "cyan"}


def store_uri(tracking_uri: str | None) -> str:
    """The MLflow store a command reads: the option, else MLFLOW_TRACKING_URI, else
    ./mlflow.db; checked to be reachable (TrackingError otherwise)."""
    from gem_platform.tracking import check_reachable, resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    check_reachable(uri)
    return uri


def runs_table(rows: list[RunRow], uri: str) -> Table:
    """One row per run: id, status, start, experiment, what it is, NE and AUC (ctr)."""
    table = Table(title=f"recent runs in {render.esc(uri)}", title_justify="left")
    for col in ("run id", "status", "started", "experiment", "run", "NE ctr", "AUC ctr"):
        table.add_column(col, no_wrap=col in ("run id", "started"), overflow="fold")
    for r in rows:
        kind = {"sweep": f"sweep {r.sweep_id}",
                "trial": f"{r.sweep_id} {r.arm} seed {r.seed}"}.get(r.role, r.name)
        started = time.strftime("%m-%d %H:%M", time.localtime(r.start_ms / 1000))
        style = STATUS_STYLE.get(r.status, "white")
        table.add_row(render.esc(r.run_id), f"[{style}]{render.esc(r.status)}[/]", started,
                      render.esc(r.experiment), render.esc(kind),
                      render.fmt(r.ne_ctr) if r.ne_ctr is not None else "",
                      render.fmt(r.auc_ctr) if r.auc_ctr is not None else "")
    return table


def runs(
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, max=10_000,
                                       help="How many runs.")] = 20,
    experiment: Annotated[str | None, typer.Option(help="Only this experiment.")] = None,
    sweep_id: Annotated[str | None, typer.Option("--sweep", help="Only this sweep's runs.")]
    = None,
    sweeps: Annotated[bool, typer.Option("--sweeps", help="Only sweeps (parent runs).")]
    = False,
    tracking_uri: TrackingOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List recent MLflow runs, newest first (ids to pass to `gemctl compare`)."""
    from gem_platform.errors import GemError
    from gem_platform.sweep.runs import list_runs
    from gem_platform.tracking import store_error

    uri = store_uri(tracking_uri)
    try:
        rows = list_runs(uri, limit, experiment, sweep_id, sweeps)
    except GemError:
        raise
    except Exception as err:  # MLflow refuses a filter or the store is unusable
        raise store_error(uri, err) from None
    if as_json:
        render.print_json({"tracking_uri": uri, "runs": [asdict(r) for r in rows]})
        return
    if not rows:
        render.console.print(f"no runs yet in {render.esc(uri)}", highlight=False)
        return
    render.wide().print(runs_table(rows, uri))


def register(app: typer.Typer) -> None:
    app.command("runs", epilog=epilog("gemctl runs -n 50", "gemctl runs --sweeps",
                                      "gemctl runs --sweep attention-20250101-120000 --json"))(
        user_errors(runs))
