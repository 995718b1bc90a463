"""gemctl jobs commands: follow and control jobs on a Ray cluster through the Ray Jobs API.

`gemctl submit RECIPE --address http://HEAD:8265` (see :func:`submit_remote`) starts a job;
`gemctl status`, `gemctl logs` and `gemctl stop` look after it.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from gemctl import render
from gemctl.errors import user_errors
from gemctl.options import JsonOpt, epilog

if TYPE_CHECKING:
    from gem_platform.remote import JobView

AddressOpt = Annotated[str | None, typer.Option(
    "--address", help="Ray Jobs API (dashboard) URL, http://HEAD:8265; default RAY_ADDRESS "
    "(when http), RAY_API_SERVER_ADDRESS, or http://127.0.0.1:8265.")]

STATUS_STYLE = {"SUCCEEDED": "green", "FAILED": "red", "STOPPED": "yellow",
                "RUNNING": "cyan", "PENDING": "cyan"}


def _styled(status: str) -> str:
    return f"[{STATUS_STYLE.get(status, 'white')}]{render.esc(status)}[/]"


def _when(value: object) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value else "-"  # type: ignore[attr-defined]


def _describe(command: str, path: Path, sets: list[str]) -> str:
    """Validate a recipe or sweep spec here, so bad input fails before any upload."""
    if command == "sweep":
        from gem_platform.sweep.config import load_sweep

        plan = load_sweep(path, sets)
        return f"sweep '{plan.name}' ({len(plan.arms)} arms x {len(plan.seeds)} seeds)"
    from gem_platform.recipe import load_recipe

    r = load_recipe(path, sets)
    return (f"recipe '{r.name}' ({r.parallel.workers} worker(s), attention={r.model.attention}, "
            f"precision={r.precision.mode})")


def submit_remote(path: Path, sets: list[str], address: str, *, local: bool = False,
                  command: str = "submit", extra_args: list[str] | None = None,
                  quiet: bool = False) -> str:
    """Validate the recipe (or sweep spec) here, submit `gemctl <command> PATH ...` as a Ray
    job on the cluster at ``address``, and say how to follow it (on stderr when ``quiet``, so
    stdout can carry JSON). Returns the job id.

    `gemctl sweep SPEC --address http://...` calls this with ``command="sweep"``.
    """
    from gem_platform.remote import resolve_jobs_address, submit_recipe

    con = render.progress_console(quiet)
    what = _describe(command, path, sets)
    address = resolve_jobs_address(address)
    con.print(f"[bold]gemctl {command}[/] {render.esc(path)}: {render.esc(what)} as a Ray job",
              highlight=False, soft_wrap=True)
    job_id = submit_recipe(path, sets, address, local=local, command=command,
                           extra_args=extra_args or [])
    # soft_wrap: the commands stay on one line each, ready to copy.
    job, where = render.esc(job_id), render.esc(address)
    con.print(f"[green]submitted[/] job [bold]{job}[/] to {where}", highlight=False,
              soft_wrap=True)
    suffix = f" --address {where}"
    con.print(f"  follow: gemctl logs {job} --follow{suffix}\n"
              f"  status: gemctl status {job}{suffix}\n"
              f"  stop:   gemctl stop {job}{suffix}", highlight=False, soft_wrap=True)
    return job_id


def jobs_table(views: list[JobView]) -> Table:
    """One row per job: id, status, start time and the gemctl command it runs."""
    table = Table(title="Ray jobs", title_justify="left")
    table.add_column("job", no_wrap=True, min_width=max([len(v.job_id) for v in views] + [3]))
    table.add_column("status", no_wrap=True)
    table.add_column("started")
    table.add_column("command", overflow="fold")
    for view in views:
        table.add_row(render.esc(view.job_id), _styled(view.status), _when(view.start_time),
                      render.esc(view.metadata.get("gem.command", view.entrypoint)))
    return table


def _view_dict(view: JobView) -> dict[str, Any]:
    return {**asdict(view), "terminal": view.terminal}


def status(
    job: Annotated[str | None, typer.Argument(help="Job id; omit to list the cluster's jobs.")]
    = None,
    address: AddressOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a job's status (or list the cluster's jobs)."""
    from gem_platform.remote import job_status, list_jobs

    if job is None:
        views = list_jobs(address)
        if as_json:
            render.print_json({"jobs": [_view_dict(v) for v in views]})
            return
        render.wide().print(jobs_table(views))
        return
    view = job_status(job, address)
    if as_json:
        render.print_json(_view_dict(view))
        return
    render.console.print(f"{render.esc(view.job_id)}: {_styled(view.status)}", highlight=False)
    render.console.print(f"  command: {render.esc(view.entrypoint)}\n"
                         f"  started: {_when(view.start_time)}\n"
                         f"  ended:   {_when(view.end_time)}", highlight=False, soft_wrap=True)
    if view.message:
        render.console.print(f"  message: {render.esc(view.message)}", highlight=False,
                             soft_wrap=True)


def logs(
    job: Annotated[str, typer.Argument(help="Job id (printed by gemctl submit).")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Stream new output until the "
                                         "job ends; exit code 1 if it did not succeed.")] = False,
    address: AddressOpt = None,
) -> None:
    """Print a job's output (driver stdout and stderr)."""
    from gem_platform.remote import follow_logs, job_logs, job_status

    if not follow:
        sys.stdout.write(job_logs(job, address))
        sys.stdout.flush()
        return
    try:
        for chunk in follow_logs(job, address):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    except KeyboardInterrupt:
        render.console.print(f"\nstopped following; job {render.esc(job)} keeps running "
                             f"(`gemctl stop {render.esc(job)}` ends it)", highlight=False,
                             soft_wrap=True)
        raise typer.Exit(130) from None
    view = job_status(job, address)
    render.console.print(f"job {render.esc(view.job_id)}: {_styled(view.status)}",
                         highlight=False)
    if view.status != "SUCCEEDED":
        raise typer.Exit(1)


def stop(
    job: Annotated[str, typer.Argument(help="Job id to stop.")],
    address: AddressOpt = None,
) -> None:
    """Stop a running job: SIGTERM first (a training run then closes its MLflow run with the
    reason), SIGKILL after Ray's grace period."""
    from gem_platform.remote import stop_job

    view = stop_job(job, address)
    render.console.print(f"{render.esc(view.job_id)}: {_styled(view.status)}", highlight=False)
    if not view.terminal:
        render.console.print(f"  still stopping; check with `gemctl status {render.esc(job)}`",
                             highlight=False, soft_wrap=True)


EXAMPLES = {
    status: ("gemctl status --address http://HEAD:8265",
             "gemctl status raysubmit_XYZ --json"),
    logs: ("gemctl logs raysubmit_XYZ --follow --address http://HEAD:8265",),
    stop: ("gemctl stop raysubmit_XYZ --address http://HEAD:8265",),
}


def register(app: typer.Typer) -> None:
    """Add this module's commands to the gemctl app."""
    for command, examples in EXAMPLES.items():
        app.command(epilog=epilog(*examples))(user_errors(command))
