"""gemctl submit: train one recipe here (embedded Ray or --local), on a Ray cluster, or as a
Ray job, under the progress display, and print its summary."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from gemctl import jobs, render
from gemctl.errors import run_failed, user_errors
from gemctl.options import JsonOpt, RecipeArg, SetOpt, TrackingOpt, VerboseOpt, epilog
from gemctl.progress import TrainingProgress
from gemctl.quiet import LibraryOutput


def submit(
    recipe: RecipeArg,
    set_: SetOpt = None,
    local: Annotated[bool, typer.Option(
        "--local", help="Train in this process (one rank, no Ray).")] = False,
    address: Annotated[str | None, typer.Option(
        "--address", help="Existing Ray cluster (ray://HEAD:10001); default RAY_ADDRESS or an "
        "embedded local Ray. http://HEAD:8265 submits a Ray job there (gemctl logs/status/"
        "stop follow it).")] = None,
    resume: Annotated[str | None, typer.Option(
        "--resume", help="MLflow run id to continue from its latest checkpoint.")] = None,
    tracking_uri: TrackingOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Validate a recipe, train it on Ray Train (or --local) and record it in MLflow; progress
    (step, loss, NE, samples/s, elapsed, ETA) while it trains, a summary table at the end."""
    from gem_platform.remote import jobs_address_for_submit

    jobs_address = jobs_address_for_submit(address, local)
    if jobs_address:  # http(s)://HEAD:8265: a Ray job there; no local training imports
        extra = (["--resume", resume] if resume else []) + (
            ["--tracking-uri", tracking_uri] if tracking_uri else [])
        job_id = jobs.submit_remote(recipe, set_ or [], jobs_address, local=local,
                                    extra_args=extra or None, quiet=as_json)
        if as_json:
            render.print_json({"job_id": job_id, "address": jobs_address})
        return
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    if tracking_uri:
        r.tracking.uri = tracking_uri
    con = render.progress_console(as_json)
    workers = 1 if local else r.parallel.workers
    epochs = r.planned_epochs(workers)
    con.print(f"[bold]gemctl submit[/] {render.esc(recipe)}: {workers} worker(s), attention="
              f"{r.model.attention}, precision={r.precision.mode}, {r.train.steps} steps"
              + ("" if epochs is None else f" ({epochs:.2f} epochs of the training split)"),
              highlight=False, soft_wrap=True)
    started = time.monotonic()
    with LibraryOutput(r.name, verbose) as lib:
        from gem_platform.launch import ResumeStopped
        from gem_platform.launch import submit as submit_run

        with TrainingProgress(con, r.name) as progress:
            try:
                outcome = submit_run(r, local=local, address=address, resume=resume,
                                     echo=progress.echo)
            except RuntimeError as err:
                where = f" Library output: {lib.path}." if lib.path else ""
                record = ("The run keeps the status it had; its tag gem.resume_stopped says "
                          "why the resume stopped." if isinstance(err, ResumeStopped) else
                          "The MLflow run is marked FAILED with the reason.")
                raise run_failed(str(err).splitlines()[0], record + where) from None
    wall_s = time.monotonic() - started
    if as_json:
        render.print_json({"run_id": outcome.run_id, "tracking_uri": outcome.tracking_uri,
                           "wall_s": wall_s, "log": str(lib.path) if lib.path else None,
                           "summary": outcome.summary})
        return
    out = render.wide()
    for table in render.summary_tables(outcome.run_id, outcome.summary, outcome.tracking_uri,
                                       wall_s):
        out.print(table)
    if lib.path:
        con.print(f"library output: {render.esc(lib.path)}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the gemctl app."""
    app.command("submit", epilog=epilog(
        "gemctl submit recipes/demo.yaml --set train.steps=50 --set model.attention=block64",
        "gemctl submit recipes/demo.yaml --local --json > result.json",
        "gemctl submit recipes/demo.yaml --address http://HEAD:8265"))(user_errors(submit))
