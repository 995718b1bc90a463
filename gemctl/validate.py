"""gemctl validate: check a recipe or sweep spec, or list the recipe's fields, without running
anything."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gemctl import render
from gemctl.errors import user_errors
from gemctl.options import JsonOpt, SetOpt, epilog


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
                               "baseline": plan.baseline,
                               "past_one_epoch": plan.past_one_epoch()})
            return
        render.console.print(
            f"[green]ok[/] {render.esc(recipe)}: sweep '{render.esc(plan.name)}' is valid "
            f"({len(plan.arms)} arms x {len(plan.seeds)} seeds, baseline "
            f"'{render.esc(plan.baseline)}'; every arm's recipe checked).", highlight=False,
            soft_wrap=True)
        if line := render.epochs_warning(plan, in_process=False):
            render.console.print(line, style="yellow", highlight=False, soft_wrap=True)
        return
    r = load_recipe(recipe, set_ or [])
    if as_json:
        render.print_json({"kind": "recipe", "valid": True, "name": r.name,
                           "recipe": r.model_dump(mode="json"),
                           "planned_epochs": r.planned_epochs()})
        return
    epochs = r.planned_epochs()
    render.console.print(f"[green]ok[/] {render.esc(recipe)}: recipe '{render.esc(r.name)}' is "
                         f"valid ({r.parallel.workers} workers, attention={r.model.attention}, "
                         f"precision={r.precision.mode}, loader={r.loader.batching}"
                         + ("" if epochs is None else f", {epochs:.2f} epochs") + ").",
                         highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the gemctl app."""
    app.command("validate", epilog=epilog(
        "gemctl validate recipes/demo.yaml --set train.steps=50",
        "gemctl validate recipes/ablations/attention.yaml",
        "gemctl validate --schema --json > recipe.schema.json"))(user_errors(validate))
