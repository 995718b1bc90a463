"""gemctl data: prepare datasets (convert MovieLens, generate synthetic data), fit the linear
reference, the bar a model has to beat on them, and report what synthetic data lets a model
learn (samples per id, AUC ceilings)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gemctl import reference, render
from gemctl.errors import user_errors
from gemctl.options import JsonOpt, RecipeArg, SetOpt, epilog, out_folder


def data_movielens(
    path: Annotated[Path, typer.Argument(help="Folder with MovieLens 100K (u.data) or 1M "
                                         "(ratings.dat) files.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Output dataset directory.",
                                          callback=out_folder)],
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


def data_reference(recipe: RecipeArg, set_: SetOpt = None, as_json: JsonOpt = False,
                   force: Annotated[bool, typer.Option(
                       help="Retrain even if a cached reference is current.")] = False,
                   epochs: Annotated[int | None, typer.Option(
                       min=1, max=100, help="Passes over the train split (default 3, the "
                       "reference runs compare against; others are cached apart).")] = None
                   ) -> None:
    """The bar to beat: held-out NE/AUC of a linear model on the recipe's data, cached there."""
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    from gem_platform.data.prepare import prepare_dataset
    from gem_platform.reference.config import LinearReferenceConfig
    from gem_platform.reference.linear import linear_reference

    meta = prepare_dataset(r.data)
    cfg = LinearReferenceConfig() if epochs is None else LinearReferenceConfig(epochs=epochs)
    outcome = linear_reference(r.data.path, meta, force=force, cfg=cfg)
    if as_json:
        render.print_json(reference.reference_json(r.data.path, outcome, meta.planted_auc))
        return
    render.wide().print(reference.reference_table(outcome, meta.planted_auc))
    render.console.print(reference.reference_origin(r.data.path, outcome), highlight=False,
                         soft_wrap=True)


def learnability_text(name: str, result: dict) -> str:
    """The learnability report as lines: training samples per id and the AUC ceilings."""
    ids = result["samples_per_id"]
    lines = [f"{name}: {result['num_train']} train samples, {result['num_users']} users, "
             f"{result['num_items']} items",
             "  training samples per id: mean over ids; over eval samples' ids: median, 10th "
             "percentile, share unseen"]
    for key, q in ids.items():
        lines.append(f"    {key:22s} {q['mean_per_id']:10.1f} {q['median_seen']:8.0f} "
                     f"{q['p10_seen']:8.0f} {q['unseen']:7.1%}")
    lines.append("  AUC ceiling: " + "; ".join(
        f"{task} " + ", ".join(f"{k} {v:.3f}" for k, v in res.items())
        for task, res in result["auc"].items()))
    return "\n".join(lines)


def data_learnability(recipe: RecipeArg, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Samples per id and the ceiling they leave: the recipe's synthetic data drawn in memory,
    the training samples of the ids eval samples meet, and the AUC an ideal learner reaches."""
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    from gem_platform.data.learnability import report

    result = report(r.data.synthetic)
    if as_json:
        render.print_json(result)
        return
    render.console.print(render.esc(learnability_text(str(recipe), result)), highlight=False,
                         soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add the ``data`` command group to the gemctl app."""
    data = typer.Typer(no_args_is_help=True, help="Prepare datasets.",
                       context_settings={"help_option_names": ["-h", "--help"]})
    data.command("movielens", epilog=epilog(
        "gemctl data movielens ml-1m/ --out gem_data/movielens"))(user_errors(data_movielens))
    data.command("generate", epilog=epilog("gemctl data generate recipes/demo.yaml --force"))(
        user_errors(data_generate))
    data.command("reference", epilog=epilog(
        "gemctl data reference recipes/demo.yaml",
        "gemctl data reference recipes/demo.yaml --epochs 1",
        "gemctl data reference recipes/demo.yaml --json"))(user_errors(data_reference))
    data.command("learnability", epilog=epilog(
        "gemctl data learnability recipes/demo.yaml --set data.synthetic.num_users=100 "
        "--json"))(user_errors(data_learnability))
    app.add_typer(data, name="data")
