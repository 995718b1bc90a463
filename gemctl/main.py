"""gemctl entry point: the typer app, its global options (--version, -h, shell completion) and
the commands that validate, submit and profile one recipe. Other command groups live in their
own modules (inspect, sweep, runs, jobs, ui, bench) and are registered here."""

from __future__ import annotations

import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Any

import typer

from gemctl import bench, inspect, jobs, reference, render, runs, sweep, ui
from gemctl.errors import EXIT_CODES, run_failed, user_errors
from gemctl.options import JsonOpt, RecipeArg, SetOpt, TrackingOpt, VerboseOpt, epilog
from gemctl.progress import TrainingProgress
from gemctl.quiet import LibraryOutput

app = typer.Typer(
    no_args_is_help=True, add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Train GEM-style recommendation models on Ray, tracked in MLflow.",
    epilog=f"Start with: gemctl validate recipes/demo.yaml, then gemctl submit "
    f"recipes/demo.yaml --local. {EXIT_CODES}")
data_app = typer.Typer(no_args_is_help=True, help="Prepare datasets.",
                       context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(data_app, name="data")


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


def _is_sweep_spec(tree: Any) -> bool:
    return isinstance(tree, dict) and "base" in tree and ("arms" in tree or "grid" in tree)


def _print_schema(as_json: bool) -> None:
    from rich.table import Table

    from gem_platform.recipe import field_rows, recipe_json_schema

    if as_json:
        render.print_json(recipe_json_schema())
        return
    table = Table(title="recipe fields (set any with --set FIELD=VALUE)", title_justify="left")
    for col in ("field", "type (range)", "default", "description"):
        table.add_column(col, overflow="fold")
    for row in field_rows():
        table.add_row(*(render.esc(cell) for cell in row))
    render.wide().print(table)


@app.command(epilog=epilog("gemctl validate recipes/demo.yaml --set train.steps=50",
                           "gemctl validate recipes/ablations/attention.yaml",
                           "gemctl validate --schema --json > recipe.schema.json"))
@user_errors
def validate(
    recipe: Annotated[Path | None, typer.Argument(
        help="Recipe or sweep spec YAML, e.g. recipes/demo.yaml or "
        "recipes/ablations/attention.yaml.", show_default=False)] = None,
    set_: SetOpt = None,
    schema: Annotated[bool, typer.Option(
        "--schema", help="Print every recipe field with its type, range, default and "
        "description (JSON Schema with --json).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check a recipe or sweep spec (schema, overrides, combinations) without running anything.
    """
    from gem_platform.errors import RecipeError

    if schema:
        _print_schema(as_json)
        return
    if recipe is None:
        raise RecipeError("Nothing to validate.",
                          "Pass a recipe or sweep spec (gemctl validate recipes/demo.yaml), or "
                          "--schema to list the recipe's fields.")
    from gem_platform.recipe import load_recipe, read_yaml_file

    if _is_sweep_spec(read_yaml_file(recipe, "Recipe or sweep spec")):
        from gem_platform.sweep.config import load_sweep

        plan = load_sweep(recipe, set_ or [])
        if as_json:
            render.print_json({"kind": "sweep", "valid": True, "name": plan.name,
                               "arms": [a.name for a in plan.arms], "seeds": plan.seeds,
                               "baseline": plan.baseline})
            return
        render.console.print(
            f"[green]ok[/] {render.esc(recipe)}: sweep '{render.esc(plan.name)}' is valid "
            f"({len(plan.arms)} arms x {len(plan.seeds)} seeds, baseline "
            f"'{render.esc(plan.baseline)}'; every arm's recipe checked).", highlight=False,
            soft_wrap=True)
        return
    r = load_recipe(recipe, set_ or [])
    if as_json:
        render.print_json({"kind": "recipe", "valid": True, "name": r.name,
                           "recipe": r.model_dump(mode="json")})
        return
    render.console.print(f"[green]ok[/] {render.esc(recipe)}: recipe '{render.esc(r.name)}' is "
                         f"valid ({r.parallel.workers} workers, attention={r.model.attention}, "
                         f"precision={r.precision.mode}, loader={r.loader.batching}).",
                         highlight=False, soft_wrap=True)


@app.command(epilog=epilog(
    "gemctl submit recipes/demo.yaml --set train.steps=50 --set model.attention=block64",
    "gemctl submit recipes/demo.yaml --local --json > result.json",
    "gemctl submit recipes/demo.yaml --address http://HEAD:8265"))
@user_errors
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
    con.print(f"[bold]gemctl submit[/] {render.esc(recipe)}: {workers} worker(s), attention="
              f"{r.model.attention}, precision={r.precision.mode}, {r.train.steps} steps",
              highlight=False, soft_wrap=True)
    started = time.monotonic()
    with LibraryOutput(r.name, verbose) as lib:
        from gem_platform.launch import submit as submit_run

        with TrainingProgress(con, r.name) as progress:
            try:
                outcome = submit_run(r, local=local, address=address, resume=resume,
                                     echo=progress.echo)
            except RuntimeError as err:
                where = f" Library output: {lib.path}." if lib.path else ""
                raise run_failed(str(err).splitlines()[0], "The MLflow run is marked FAILED "
                                 f"with the reason.{where}") from None
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


@app.command(epilog=epilog(
    "gemctl profile recipes/h200.yaml --set precision.mode=fp8_block --out prof.json",
    "gemctl profile recipes/demo.yaml --warmup 3 --active 2 --trace step.trace.json"))
@user_errors
def profile(
    recipe: RecipeArg,
    set_: SetOpt = None,
    warmup: Annotated[int, typer.Option(help="Steps before profiling (autotuning, "
                                        "compilation); at least 2.")] = 20,
    active: Annotated[int, typer.Option(help="Profiled steps.", min=1)] = 10,
    top: Annotated[int, typer.Option(help="Kernels listed.", min=1)] = 25,
    out: Annotated[Path | None, typer.Option(help="Write the profile as JSON here.")] = None,
    trace: Annotated[Path | None, typer.Option(
        help="Write the profiled steps as a Chrome/Perfetto trace here (open it in "
        "ui.perfetto.dev or chrome://tracing), and report from it the device's idle gaps and "
        "the host's time by site (beside --out as <out stem>.gaps.json).")] = None,
    min_gap_us: Annotated[float, typer.Option(
        help="Shortest device idle gap counted (with --trace).", min=0)] = 20.0,
    verbose: VerboseOpt = False,
) -> None:
    """Where a step's time goes: train the recipe a few steps here under torch.profiler."""
    from gem_platform.errors import GemError
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    for path in (out, trace):
        if path is not None and not path.resolve().parent.is_dir():
            raise GemError(f"Folder {path.parent} (for {path.name}) does not exist.",
                           "Create it or pass a path in an existing folder.")
    with LibraryOutput(f"profile-{r.name}", verbose):
        from gem_profile.profile import profile_recipe, render_profile, write_profile

        with TrainingProgress(render.console, r.name) as progress:
            result = profile_recipe(r, warmup, active, top, echo=progress.echo,
                                    trace=trace)
    render_profile(result, render.wide())
    if out:
        render.console.print(f"profile: {render.esc(write_profile(result, out))}",
                             highlight=False)
    if trace:
        render.console.print(f"trace: {render.esc(trace)} (open in ui.perfetto.dev)",
                             highlight=False)
        from gem_profile.gaps import report_trace_gaps

        gaps = report_trace_gaps(trace, out, render.wide(), min_gap_us)
        if gaps:
            render.console.print(f"gaps: {render.esc(gaps)}", highlight=False)


@data_app.command("movielens", epilog=epilog(
    "gemctl data movielens ml-1m/ --out gem_data/movielens"))
@user_errors
def data_movielens(
    path: Annotated[Path, typer.Argument(help="Folder with MovieLens 100K (u.data) or 1M "
                                         "(ratings.dat) files.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Output dataset directory.")],
    eval_fraction: Annotated[float, typer.Option(
        help="Share of each user's latest ratings held out.", min=0.0, max=0.9)] = 0.1,
) -> None:
    """Convert MovieLens 100K (u.data...) or 1M (ratings.dat...) files into GEM Parquet shards."""
    from gem_platform.data.movielens import convert_movielens

    meta = convert_movielens(str(path), str(out), eval_fraction=eval_fraction)
    render.console.print(f"[green]wrote[/] {render.esc(out)}: {meta.num_train} train / "
                         f"{meta.num_eval} eval samples, {meta.num_items} items, CTR base rate "
                         f"{meta.ctr_base_rate:.3f} ({render.esc(meta.source)}).",
                         highlight=False)


@data_app.command("generate", epilog=epilog("gemctl data generate recipes/demo.yaml --force"))
@user_errors
def data_generate(recipe: RecipeArg, set_: SetOpt = None,
                  force: Annotated[bool, typer.Option(help="Regenerate even if present.")] = False
                  ) -> None:
    """Generate the recipe's synthetic dataset (submit does this on demand too)."""
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    from gem_platform.data.ceilings import describe_ceilings
    from gem_platform.data.prepare import prepare_dataset

    meta = prepare_dataset(r.data, force=force)
    render.console.print(f"[green]ready[/] {render.esc(r.data.path)}: {meta.num_train} train / "
                         f"{meta.num_eval} eval samples; planted AUC "
                         f"{render.esc(meta.planted_auc)}.", highlight=False)
    for line in describe_ceilings(meta.planted_auc, meta.extra):
        render.console.print(f"  {render.esc(line)}", highlight=False, soft_wrap=True)


@data_app.command("reference", epilog=epilog("gemctl data reference recipes/demo.yaml",
                                              "gemctl data reference recipes/demo.yaml --json"))
@user_errors
def data_reference(recipe: RecipeArg, set_: SetOpt = None, as_json: JsonOpt = False,
                   force: Annotated[bool, typer.Option(
                       help="Retrain even if a cached reference is current.")] = False) -> None:
    """The bar to beat: held-out NE/AUC of a linear model on the recipe's data, cached there."""
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    from gem_platform.data.prepare import prepare_dataset
    from gem_platform.reference.linear import linear_reference

    meta = prepare_dataset(r.data)
    outcome = linear_reference(r.data.path, meta, force=force)
    if as_json:
        render.print_json(reference.reference_json(r.data.path, outcome, meta.planted_auc))
        return
    render.wide().print(reference.reference_table(outcome, meta.planted_auc))
    render.console.print(reference.reference_origin(r.data.path, outcome), highlight=False,
                         soft_wrap=True)


for _module in (inspect, sweep, runs, jobs, ui, bench):
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
