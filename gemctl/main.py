"""gemctl entry point: typer commands over gem_platform."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from gemctl import render

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Train GEM-style recommendation models on Ray, tracked in MLflow.")
data_app = typer.Typer(no_args_is_help=True, help="Prepare datasets.")
app.add_typer(data_app, name="data")

SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", "-s", help="Override a recipe field: --set train.steps=50 (repeatable).")]


def _terminate_as_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input -> one clear paragraph on stderr and exit code 2; failed run -> exit code 1.

    SIGTERM is handled like Ctrl-C, so a killed submission still closes its MLflow run.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from gem_platform.errors import GemError

        signal.signal(signal.SIGTERM, _terminate_as_interrupt)
        try:
            return fn(*args, **kwargs)
        except GemError as err:
            render.error(err.problem, err.fix)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            render.error("Interrupted.")
            raise typer.Exit(130) from None

    return wrapper


@app.command()
@user_errors
def validate(recipe: Path, set_: SetOpt = None) -> None:
    """Check a recipe (schema, overrides, combinations) without running anything."""
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    render.console.print(f"[green]ok[/] {recipe}: recipe '{r.name}' is valid "
                         f"({r.parallel.workers} workers, attention={r.model.attention}, "
                         f"precision={r.precision.mode}, loader={r.loader.batching}).")


@app.command()
@user_errors
def submit(
    recipe: Path,
    set_: SetOpt = None,
    local: Annotated[bool, typer.Option(
        "--local", help="Train in this process (one rank, no Ray).")] = False,
    address: Annotated[str | None, typer.Option(
        "--address", help="Existing Ray cluster (ray://HEAD:10001); default RAY_ADDRESS or an "
        "embedded local Ray. http://HEAD:8265 submits a Ray job there (gemctl logs/status/"
        "stop follow it).")] = None,
    resume: Annotated[str | None, typer.Option(
        "--resume", help="MLflow run id to continue from its latest checkpoint.")] = None,
) -> None:
    """Validate a recipe, train it on Ray Train (or --local) and record it in MLflow."""
    from gem_platform.remote import jobs_address_for_submit

    jobs_address = jobs_address_for_submit(address, local)
    if jobs_address:  # http(s)://HEAD:8265: a Ray job there; no local training imports
        from gemctl.jobs import submit_remote

        submit_remote(recipe, set_ or [], jobs_address, local=local,
                      extra_args=["--resume", resume] if resume else None)
        return
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    from gem_platform.launch import submit as submit_run

    workers = 1 if local else r.parallel.workers
    render.console.print(f"[bold]gemctl submit[/] {recipe}: {workers} worker(s), attention="
                         f"{r.model.attention}, precision={r.precision.mode}, "
                         f"{r.train.steps} steps")
    try:
        outcome = submit_run(r, local=local, address=address, resume=resume,
                             echo=lambda line: render.console.print(line, highlight=False))
    except RuntimeError as err:
        render.error(str(err).splitlines()[0],
                     "The MLflow run is marked FAILED with the reason; see the log above.")
        raise typer.Exit(1) from None
    for table in render.summary_tables(outcome.run_id, outcome.summary, outcome.tracking_uri):
        render.console.print(table)


@app.command()
@user_errors
def profile(
    recipe: Path,
    set_: SetOpt = None,
    warmup: Annotated[int, typer.Option(help="Steps before profiling (autotuning, "
                                        "compilation); at least 2.")] = 20,
    active: Annotated[int, typer.Option(help="Profiled steps.")] = 10,
    top: Annotated[int, typer.Option(help="Kernels listed.")] = 25,
    out: Annotated[Path | None, typer.Option(help="Write the profile as JSON here.")] = None,
) -> None:
    """Where a step's time goes: train the recipe a few steps here under torch.profiler."""
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    from gem_platform.train.profile import profile_recipe, render_profile, write_profile

    result = profile_recipe(r, warmup, active, top,
                            echo=lambda line: render.console.print(line, highlight=False))
    render_profile(result, render.console)
    if out:
        render.console.print(f"profile: {write_profile(result, out)}")


@data_app.command("movielens")
@user_errors
def data_movielens(
    path: Path,
    out: Annotated[Path, typer.Option("--out", help="Output dataset directory.")],
    eval_fraction: Annotated[float, typer.Option(help="Share of each user's latest ratings "
                                                 "held out.")] = 0.1,
) -> None:
    """Convert MovieLens 100K (u.data...) or 1M (ratings.dat...) files into GEM Parquet shards."""
    from gem_platform.data.movielens import convert_movielens

    meta = convert_movielens(str(path), str(out), eval_fraction=eval_fraction)
    render.console.print(f"[green]wrote[/] {out}: {meta.num_train} train / {meta.num_eval} eval "
                         f"samples, {meta.num_items} items, CTR base rate "
                         f"{meta.ctr_base_rate:.3f} ({meta.source}).")


@data_app.command("generate")
@user_errors
def data_generate(recipe: Path, set_: SetOpt = None,
                  force: Annotated[bool, typer.Option(help="Regenerate even if present.")] = False
                  ) -> None:
    """Generate the recipe's synthetic dataset (submit does this on demand too)."""
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    meta = r.data.prepare(force=force)
    render.console.print(f"[green]ready[/] {r.data.path}: {meta.num_train} train / "
                         f"{meta.num_eval} eval samples; planted AUC {meta.planted_auc}.")


@app.command()
def ui(
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1.")] = 5000,
    host: Annotated[str, typer.Option(help="Bind address; keep 127.0.0.1 unless you mean to "
                                      "expose it.")] = "127.0.0.1",
    backend_store_uri: Annotated[str | None, typer.Option(
        help="Default: MLFLOW_TRACKING_URI or ./mlflow.db")] = None,
) -> None:
    """Open the MLflow UI over this project's runs (binds 127.0.0.1 by default)."""
    from gem_platform.tracking import resolve_tracking_uri

    uri = backend_store_uri or resolve_tracking_uri(None)
    render.console.print(f"MLflow UI on http://{host}:{port} over {uri}")
    cmd = [sys.executable, "-m", "mlflow", "ui", "--host", host, "--port", str(port),
           "--backend-store-uri", uri]
    raise typer.Exit(subprocess.call(cmd, env=dict(os.environ)))


def _register_command_groups() -> None:
    """Commands that live in their own modules (one module per product area)."""
    from gemctl import bench, inspect, jobs, sweep

    for module in (inspect, sweep, jobs, bench):
        module.register(app)


_register_command_groups()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
