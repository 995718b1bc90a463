"""gemctl plan and profile-data: what a run would do, computed without training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from gem_platform.json_results import write_json
from gemctl import render
from gemctl.errors import user_errors
from gemctl.options import JsonOpt, RecipeArg, SetOpt, epilog, out_file, out_folder

if TYPE_CHECKING:
    from gem_platform.data.meta import DatasetMeta
    from gem_platform.recipe import Recipe
    from gem_platform.topology.plan import Plan


def planning_meta(r: Recipe, meta_file: Path | None) -> tuple[DatasetMeta, str]:
    """The dataset sizes a plan prices, and where they came from: ``--meta FILE``, else the
    dataset's meta.json if it is on this machine, else the recipe's own synthetic sizes (a
    cluster's data need not be reachable from where the plan is made)."""
    from gem_platform.data.meta import META_FILE, DatasetMeta
    from gem_platform.errors import GemError
    from gem_platform.model.sizes import planning_meta as recipe_meta

    if meta_file is not None:
        folder = meta_file if meta_file.is_dir() else meta_file.parent
        if meta_file.is_file() and meta_file.name != META_FILE:
            raise GemError(f"--meta {meta_file}: expected a file named {META_FILE} (or its "
                           "folder).", "Pass the meta.json of a converted or generated dataset.")
        try:
            return DatasetMeta.load(folder), f"{folder / META_FILE}"
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise GemError(f"--meta {meta_file}: can't read {folder / META_FILE} ({err}).",
                           "Pass the meta.json that `gemctl data generate` or `gemctl data "
                           "movielens` wrote.") from None
    on_disk = Path(r.data.path) / META_FILE
    if on_disk.exists() or r.data.source == "synthetic":
        return recipe_meta(r), str(on_disk) if on_disk.exists() else "the recipe's data.synthetic"
    return recipe_meta(r.model_copy(update={"data": r.data.model_copy(
        update={"source": "synthetic"})})), (
        f"the recipe's data.synthetic ({on_disk} is not on this machine; --meta FILE prices "
        "the real dataset)")


def check_tables(dataset: DatasetMeta, r: Recipe, sizes_from: str) -> None:
    """Refuse dataset sizes that give the model a table no cluster could hold, before the
    model is built (torch would fail inside its construction)."""
    from gem_platform.topology.table_bounds import check_meta_tables

    check_meta_tables(dataset, r.model.d_model, r.model.sparse_dim, sizes_from)


def check_cluster_size(**options: int | None) -> None:
    """Refuse, before anything loads, a cluster larger than any run can be: ``options`` maps
    an option's spelling (``world``) to its value."""
    from gem_platform.errors import GemError
    from gem_platform.topology.config import MAX_WORLD

    for name, value in options.items():
        if value is not None and value > MAX_WORLD:
            flag = "--" + name.replace("_", "-")
            raise GemError(
                f"{flag} {value:,} is beyond the largest cluster gemctl plans for ({MAX_WORLD:,} "
                "ranks: more than any cluster trains one model on, and every rank's groups "
                "and batches are computed one by one).",
                f"Pass the cluster's real size, at most {MAX_WORLD:,} (e.g. {flag} 4096).")


def plan_tables(p: Plan, world: int, gph: int, hosts_per_zone: int | None) -> list[Table]:
    """Process groups, collectives per step, and the flat baseline, as rich tables."""
    from gem_platform.topology import COLUMNS, GROUP_COLUMNS

    groups = Table(title=f"process groups: {world} ranks, {gph} per host, "
                         f"{hosts_per_zone or 'all'} hosts per zone", title_justify="left")
    colls = Table(title="collectives per step (bytes one rank sends)", title_justify="left")
    base = Table(title="baseline: plain FSDP over all ranks + global embedding all_to_all",
                 title_justify="left")
    for table, columns, rows in ((groups, GROUP_COLUMNS, p.group_rows()),
                                 (colls, COLUMNS, p.rows()), (base, COLUMNS, p.baseline_rows())):
        for c in columns:
            table.add_column(render.esc(c))
        for row in rows:
            table.add_row(*(render.esc(cell) for cell in row))
    return [groups, colls, base]


def plan(
    recipe: RecipeArg,
    set_: SetOpt = None,
    world: Annotated[int | None, typer.Option(
        min=1, help="Ranks (default parallel.workers).")] = None,
    gpus_per_host: Annotated[int, typer.Option(min=1, help="Ranks per host (NVLink domain).")]
    = 8,
    hosts_per_zone: Annotated[int | None, typer.Option(min=1, help="Hosts per zone.")] = None,
    meta: Annotated[Path | None, typer.Option(
        help="The dataset's meta.json (or its folder) for table sizes; default the recipe's "
        "data.path if present, else the recipe's data.synthetic sizes.")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Also write the plan as JSON to this file.", callback=out_file)]
    = None,
    as_json: JsonOpt = False,
) -> None:
    """Print every process group, the network tier each collective crosses and its bytes per
    step, for the recipe's model on a cluster of the given shape."""
    check_cluster_size(world=world, gpus_per_host=gpus_per_host, hosts_per_zone=hosts_per_zone)
    from gem_platform.recipe import load_recipe
    from gem_platform.topology import ClusterShape, build_plan
    from gem_platform.topology.plan import human_bytes

    cluster_sets = []
    if world is not None:  # the recipe is checked against the planned cluster, not its own
        cluster_sets = [f"parallel.workers={world}",
                        f"parallel.gpus_per_host={min(gpus_per_host, world)}"]
        if hosts_per_zone is not None:
            cluster_sets.append(f"parallel.hosts_per_zone={hosts_per_zone}")
    r = load_recipe(recipe, [*(set_ or []), *cluster_sets])
    # The model (torch, the kernels) loads only once the recipe is valid.
    import torch

    from gem_platform.model import GemModel
    from gem_platform.model.sizes import model_sizes

    dataset, sizes_from = planning_meta(r, meta)
    check_tables(dataset, r, sizes_from)
    world = r.parallel.workers
    gph = min(gpus_per_host, world)
    with torch.device("meta"):  # every size, no memory
        model = GemModel(r.model, dataset)
    p = build_plan(r.parallel, ClusterShape(world, gph, hosts_per_zone), model_sizes(model, r))
    if out:
        out.write_text(p.to_json())
    if as_json:
        body: dict[str, Any] = json.loads(p.to_json())
        body["sizes_from"] = sizes_from
        render.print_json(body)
        return
    con = render.wide()
    for t in plan_tables(p, world, gph, hosts_per_zone):
        con.print(t)
    mem = ", ".join(f"{k} {human_bytes(v)}" for k, v in p.memory_per_rank().items())
    con.print(f"parameters per rank, as gathered: {render.esc(mem)}", highlight=False)
    state = ", ".join(f"{k} {human_bytes(v)}" for k, v in p.training_state_per_rank().items())
    con.print(f"training state per rank (fp32 weights, gradients, AdamW moments; table rows "
              f"and Adagrad state; activations come on top, bounded by "
              f"train.activation_memory_gb): {render.esc(state)}", highlight=False)
    con.print(f"data sizes from {render.esc(sizes_from)}", highlight=False)
    if out:
        con.print(f"wrote {render.esc(out)}", highlight=False)


def profile_table(summary: dict[str, Any], title: str) -> Table:
    """One row per balancing method. Headers break at underscores ("straggler" over "p95"),
    so every column keeps a distinct, whole name within 120 columns."""
    table = Table(title=render.esc(title), title_justify="left")
    rows = summary.get("rows") or []
    for c in rows[0] if rows else []:
        table.add_column(render.esc(c).replace("_", "\n"), justify="left" if c == "method"
                         else "right")
    for row in rows:
        table.add_row(*(render.fmt(v) for v in row.values()))
    return table


def profile_data(
    recipe: RecipeArg,
    set_: SetOpt = None,
    world: Annotated[int | None, typer.Option(
        min=1, help="Ranks (default parallel.workers).")] = None,
    local_batch: Annotated[int | None, typer.Option(
        min=1, help="Samples per rank per step (default loader.local_batch_size).")] = None,
    out: Annotated[Path, typer.Option(
        help="Folder for the JSON and the PNG histogram.", callback=out_folder)]
    = Path("gem_runs/profile"),
    as_json: JsonOpt = False,
) -> None:
    """Padding waste and straggler overhead of the recipe's data, without training: no
    balancing vs BBS vs a global balanced partition (the upper bound)."""
    check_cluster_size(world=world)
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    from gem_platform.balance.profile import check_profile_size, profile_lengths
    from gem_platform.data.prepare import prepare_dataset

    world = world or r.parallel.workers
    cfg = r.loader_config()
    if local_batch is not None:
        cfg = cfg.model_copy(update={"local_batch_size": local_batch})
    if r.data.source == "synthetic":  # refused from the recipe, before generating
        check_profile_size(r.data.synthetic.num_train, world, cfg.local_batch_size)
    check_profile_size(prepare_dataset(r.data).num_train, world, cfg.local_batch_size)
    from gem_platform.data.loader import split_lengths

    lengths = split_lengths(r.data.path, "train",
                            truncate=r.data.history_overflow == "truncate")
    report = profile_lengths(lengths, world=world, local_batch=cfg.local_batch_size, cfg=cfg)
    summary = report.to_dict()
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "profile.json", summary, indent=2, default=float)
    report.save_png(out / "rank_work.png")
    if as_json:
        render.print_json(summary)
        return
    render.wide().print(profile_table(summary, f"{len(lengths)} samples, {world} ranks x "
                                      f"{cfg.local_batch_size} per step, cost={cfg.cost}"))
    render.console.print(f"wrote {render.esc(out / 'profile.json')} and "
                         f"{render.esc(out / 'rank_work.png')}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("plan", epilog=epilog(
        "gemctl plan recipes/multinode.yaml",
        "gemctl plan recipes/demo.yaml --world 4096 --gpus-per-host 8 --hosts-per-zone 32 "
        "--set parallel.hsdp_shard_group=128 --json > plan.json",
        "gemctl plan recipes/movielens.yaml --meta gem_data/movielens/meta.json --out plan.json",
    ))(user_errors(plan))
    app.command("profile-data", epilog=epilog(
        "gemctl profile-data recipes/demo.yaml --world 8",
        "gemctl profile-data recipes/demo.yaml --local-batch 512 --json"))(
        user_errors(profile_data))
