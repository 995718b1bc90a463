"""gemctl profile: where a step's time goes, from a few steps trained here under
torch.profiler."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gemctl import render
from gemctl.errors import user_errors
from gemctl.options import RecipeArg, SetOpt, VerboseOpt, epilog, out_file
from gemctl.progress import TrainingProgress
from gemctl.quiet import LibraryOutput


def profile(
    recipe: RecipeArg,
    set_: SetOpt = None,
    warmup: Annotated[int, typer.Option(help="Steps before profiling (autotuning, "
                                        "compilation); at least 2.")] = 20,
    active: Annotated[int, typer.Option(help="Profiled steps.", min=1)] = 10,
    top: Annotated[int, typer.Option(help="Kernels listed.", min=1)] = 25,
    out: Annotated[Path | None, typer.Option(help="Write the profile as JSON here.",
                                                    callback=out_file)] = None,
    trace: Annotated[Path | None, typer.Option(
        help="Write the profiled steps as a Chrome/Perfetto trace here (open it in "
        "ui.perfetto.dev or chrome://tracing), and report from it the device's idle gaps and "
        "the host's time by site (beside --out as <out stem>.gaps.json).",
        callback=out_file)] = None,
    min_gap_us: Annotated[float, typer.Option(
        help="Shortest device idle gap counted (with --trace).", min=0)] = 20.0,
    verbose: VerboseOpt = False,
) -> None:
    """Where a step's time goes: train the recipe a few steps here under torch.profiler."""
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
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


def register(app: typer.Typer) -> None:
    """Add this module's commands to the gemctl app."""
    app.command("profile", epilog=epilog(
        "gemctl profile recipes/h200.yaml --set precision.mode=fp8_block --out prof.json",
        "gemctl profile recipes/demo.yaml --warmup 3 --active 2 --trace step.trace.json"))(
        user_errors(profile))
