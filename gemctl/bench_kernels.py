"""gemctl bench kernels: the kernel-speed guard. Times each kernel's key shapes on the GPU,
prints them against the committed figures and, with --check, fails on a slowdown."""

from __future__ import annotations

from typing import Annotated

import typer

from gemctl import render
from gemctl.errors import EXIT_FAILED
from gemctl.options import out_folder

HELP = ("Kernel-speed guard: each kernel's key shapes (jagged self-attention, GDPA self / "
        "cross / pooled, block64 with RoPE, FP8 linear), forward and forward+backward, timed "
        "on the GPU and compared with the committed H200 figures (docs/bench/"
        "kernel_guard.json). --check exits 1 when any is slower than --max-slowdown allows.")
EXAMPLES = ("gemctl bench kernels --check",
            "gemctl bench kernels --check --only gdpa_cross,gdpa_pooled --max-slowdown 5%",
            "gemctl bench kernels --update")


def kernels(
    check: Annotated[bool, typer.Option(
        help="Exit 1 when a key shape is slower than its committed figure by more than "
             "--max-slowdown, or could not be measured.")] = False,
    max_slowdown: Annotated[str, typer.Option(
        help="Largest slowdown allowed against the committed figure (e.g. 10%).")] = "10%",
    update: Annotated[bool, typer.Option(
        help="Rewrite the figures file from this run's times (commit and device recorded).")
    ] = False,
    only: Annotated[str | None, typer.Option(
        help="Comma-separated key shapes to time (default: all).")] = None,
    figures: Annotated[str, typer.Option(help="The committed figures file.")
                       ] = "docs/bench/kernel_guard.json",
    out: Annotated[str, typer.Option(help="Folder for kernel_check.json.",
                                         callback=out_folder)] = "bench_results",
) -> None:
    from gem_bench.kernels import guard
    from gem_bench.kernels.guard_figures import keys, parse_slowdown

    allowed = parse_slowdown(max_slowdown)
    names = [n.strip() for n in only.split(",") if n.strip()] if only else None
    keys(names)  # unknown names are bad input before any GPU work
    report = guard.run(names, figures, out, allowed, update)
    _print(report)
    if check and report.failed:
        raise typer.Exit(EXIT_FAILED)


def _print(report) -> None:  # noqa: ANN001 - gem_bench.kernels.guard.GuardReport
    from rich.table import Table

    table = Table(title=f"kernel guard on {render.esc(report.device)} (slowdown allowed "
                        f"{report.max_slowdown:.0%})", title_justify="left")
    for col in ("key", "committed ms", "measured ms", "ratio", "verdict"):
        table.add_column(col, justify="left" if col in ("key", "verdict") else "right")
    for v in report.verdicts:
        style = "red" if v.failed else ("yellow" if v.committed_ms is None else "green")
        table.add_row(render.esc(v.key), _ms(v.committed_ms), _ms(v.measured_ms),
                      "-" if v.ratio is None else f"{v.ratio:.3f}",
                      f"[{style}]{render.esc(v.verdict)}[/]")
    console = render.wide()
    console.print(table)
    for key, err in report.errors.items():
        console.print(f"{render.esc(key)}: {render.esc(err)}", highlight=False)
    for path in report.written:
        console.print(f"wrote {render.esc(path)}", highlight=False)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
