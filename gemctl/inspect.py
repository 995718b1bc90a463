"""gemctl plan and profile-data: what a run would do, computed without training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from gemctl import render


def plan(
    recipe: Path,
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help="Recipe override.")]
    = None,
    world: Annotated[int | None, typer.Option(help="Ranks (default parallel.workers).")] = None,
    gpus_per_host: Annotated[int, typer.Option(help="Ranks per host (NVLink domain).")] = 8,
    hosts_per_zone: Annotated[int | None, typer.Option(help="Hosts per zone.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the plan as JSON."
                                                  )] = None,
) -> None:
    """Print every process group, the network tier each collective crosses and its bytes per
    step, for the recipe's model on a cluster of the given shape."""
    from gem_platform.recipe import load_recipe
    from gem_platform.topology import COLUMNS, GROUP_COLUMNS, ClusterShape, build_plan
    from gem_platform.topology.plan import human_bytes

    cluster_sets = []
    if world is not None:  # the recipe is checked against the planned cluster, not its own
        cluster_sets = [f"parallel.workers={world}",
                        f"parallel.gpus_per_host={min(gpus_per_host, world)}"]
        if hosts_per_zone is not None:
            cluster_sets.append(f"parallel.hosts_per_zone={hosts_per_zone}")
    r = load_recipe(recipe, [*(set_ or []), *cluster_sets])
    # The model (torch, the kernels) loads only once the recipe is valid.
    from gem_platform.model.sizes import model_sizes, planning_model

    world = r.parallel.workers
    gph = min(gpus_per_host, world)
    sizes = model_sizes(planning_model(r), r)
    p = build_plan(r.parallel, ClusterShape(world, gph, hosts_per_zone), sizes)
    groups = Table(title=f"process groups: {world} ranks, {gph} per host, "
                         f"{hosts_per_zone or 'all'} hosts per zone", title_justify="left")
    for c in GROUP_COLUMNS:
        groups.add_column(c)
    for row in p.group_rows():
        groups.add_row(*row)
    colls = Table(title="collectives per step (bytes one rank sends)", title_justify="left")
    for c in COLUMNS:
        colls.add_column(c)
    for row in p.rows():
        colls.add_row(*row)
    base = Table(title="baseline: plain FSDP over all ranks + global embedding all_to_all",
                 title_justify="left")
    for c in COLUMNS:
        base.add_column(c)
    for row in p.baseline_rows():
        base.add_row(*row)
    for t in (groups, colls, base):
        render.console.print(t)
    mem = ", ".join(f"{k} {human_bytes(v)}" for k, v in p.memory_per_rank().items())
    render.console.print(f"state per rank: {mem}")
    if json_out:
        json_out.write_text(p.to_json())
        render.console.print(f"wrote {json_out}")


def profile_data(
    recipe: Path,
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help="Recipe override.")]
    = None,
    world: Annotated[int | None, typer.Option(help="Ranks (default parallel.workers).")] = None,
    local_batch: Annotated[int | None, typer.Option(
        help="Samples per rank per step (default loader.local_batch_size).")] = None,
    out: Annotated[Path, typer.Option(help="Folder for the JSON and the PNG histogram.")]
    = Path("gem_runs/profile"),
) -> None:
    """Padding waste and straggler overhead of the recipe's data, without training: no
    balancing vs BBS vs a global balanced partition (the upper bound)."""
    from gem_platform.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    from gem_platform.balance.profile import profile_lengths
    from gem_platform.data.parquet import SampleTable

    r.data.prepare()
    lengths = SampleTable.load(r.data.path, "train").seq_lengths
    world = world or r.parallel.workers
    cfg = r.loader_config()
    if local_batch is not None:
        cfg = cfg.model_copy(update={"local_batch_size": local_batch})
    report = profile_lengths(lengths, world=world, local_batch=cfg.local_batch_size, cfg=cfg)
    table = Table(title=f"{len(lengths)} samples, {world} ranks x {cfg.local_batch_size} "
                        f"per step, cost={cfg.cost}", title_justify="left")
    summary = report.to_dict()
    rows = summary["rows"]
    for c in rows[0] if rows else []:
        table.add_column(c)
    for row in rows:
        table.add_row(*(render.fmt(v) for v in row.values()))
    render.console.print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(summary, indent=2, default=float))
    report.save_png(out / "rank_work.png")
    render.console.print(f"wrote {out / 'profile.json'} and {out / 'rank_work.png'}")


def register(app: typer.Typer) -> None:
    from gemctl.main import user_errors

    app.command("plan")(user_errors(plan))
    app.command("profile-data")(user_errors(profile_data))
