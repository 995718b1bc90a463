"""gemctl bench: the kernel, loader and training benchmarks, and the repeatability and
compile checks. Each prints a table and writes JSON; the kernel ones need a CUDA GPU and time
ours against named baselines in the same run."""

from __future__ import annotations

import importlib
from typing import Annotated

import typer

from gemctl import bench_kernels
from gemctl.errors import user_errors
from gemctl.options import epilog, out_folder

BENCHES: dict[str, tuple[str, str]] = {
    "attention": ("gem_bench.kernels.jfa",
                  "Jagged flash attention vs varlen_attn, nested SDPA, padded SDPA."),
    "gdpa": ("gem_bench.kernels.gdpa",
             "GDPA self / cross / pooled vs the padded reference, eager and compiled."),
    "block": ("gem_bench.kernels.block_attention",
              "64-token block attention + RoPE vs SDPA on blocks, FlexAttention, sliding JFA."),
    "deterministic": ("gem_bench.kernels.deterministic",
                      "Deterministic vs fast backward of each attention op: time and bitwise "
                      "repeatability."),
    "fp8": ("gem_bench.kernels.fp8_linear",
            "FP8 block-scaled linear vs bf16 matmul vs rowwise torch._scaled_mm."),
    "fp8-cost": ("gem_bench.kernels.fp8_layer_cost",
                 "One FP8 layer's training call at narrow recipe shapes vs bf16 nn.Linear: "
                 "host time, GPU time, launches."),
    "fp8-saved": ("gem_bench.kernels.fp8_saved",
                  "FP8 saved activations: the Triton quantize/dequantize passes vs the eager "
                  "PyTorch chain, TB/s against HBM."),
    "bbs": ("gem_bench.bbs",
            "Straggler overhead without balancing, with BBS, with BBS v2 and with a global "
            "partition (CPU)."),
    "loader": ("gem_bench.loader",
               "Streaming reader vs in-memory table: reader + collate samples/s, time to first "
               "batch, peak RSS against the dataset's size (CPU)."),
}


def _command(module: str):
    def run(
        out: Annotated[str, typer.Option(
            help="Folder for the JSON results.", callback=out_folder)] = "bench_results",
        quick: Annotated[bool, typer.Option(help="Smaller inputs, fewer cases.")] = False,
    ) -> None:
        argv = ["--out", out] + (["--quick"] if quick else [])
        result = importlib.import_module(module).main(argv)
        raise typer.Exit(result if isinstance(result, int) else 0)

    return run


def _e2e(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML.")] = "recipes/h200_gem.yaml",
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override a recipe field (repeatable).")] = None,
    steps: Annotated[int, typer.Option(help="Timed steps per arm.")] = 20,
    warmup: Annotated[int, typer.Option(help="Untimed steps first (compilation).")] = 10,
    out: Annotated[str, typer.Option(
        help="Folder for the JSON result.", callback=out_folder)] = "docs/bench",
    quick: Annotated[bool, typer.Option(help="3 warm-up, 5 timed, 2 profiled steps.")] = False,
    arms: Annotated[str, typer.Option(
        help="Comma-separated arms: ours, off_the_shelf (the default pair), ours_dense_tables, "
             "ours_fp8_saved, ours_eager, ours_fp8_block, ours_fp8_wgrad, ours_deterministic.")
    ] = "ours,off_the_shelf",
    profile_steps: Annotated[int, typer.Option(help="Profiled steps per arm.")] = 3,
    repeats: Annotated[int, typer.Option(
        help="Runs per arm, in rounds taking the arms in turn; each arm reports its median run "
             "(launch-bound recipes' speed varies from process to process).")] = 1,
    same_process: Annotated[bool, typer.Option(
        help="Train every arm in this process (default: each in a fresh one).")] = False,
) -> None:
    from gem_bench.e2e import main

    argv = [recipe, "--steps", str(steps), "--warmup", str(warmup), "--out", out,
            "--arms", arms, "--profile-steps", str(profile_steps), "--repeats", str(repeats)]
    argv += _overrides(set_) + (["--quick"] if quick else [])
    argv += ["--same-process"] if same_process else []
    raise typer.Exit(main(argv))


def _overrides(set_: list[str] | None) -> list[str]:
    return [a for s in set_ or [] for a in ("--set", s)]


def _repro(
    recipes: Annotated[list[str], typer.Argument(help="Recipe YAML files.")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override applied to every recipe (repeatable).")] = None,
    grads: Annotated[bool, typer.Option(
        help="Also compare one unclipped deterministic step's gradients from two more "
             "processes, naming those that differ.")] = False,
    grads_only: Annotated[bool, typer.Option(
        help="Only that gradient check (a quick predicate: exit 0 when they agree).")] = False,
    in_one_process: Annotated[bool, typer.Option(
        help="With --grads/--grads-only: that step twice in one process (differences then "
             "come from run time, not compilation).")] = False,
    out: Annotated[str, typer.Option(help="Folder for repro_bench.json.",
                                         callback=out_folder)] = "bench_results",
) -> None:
    from gem_bench.repro import main

    argv = [*recipes, "--out", out, *_overrides(set_)]
    argv += (["--grads"] if grads else []) + (["--grads-only"] if grads_only else [])
    argv += ["--grads-in-one-process"] if in_one_process else []
    raise typer.Exit(main(argv))


def _compile_check(
    recipes: Annotated[list[str], typer.Argument(help="Recipe YAML files.")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override applied to every recipe and both runs (repeatable).")
    ] = None,
    tolerance: Annotated[float | None, typer.Option(
        help="Largest relative L2 error allowed (default: 1e-3 in fp32, 3e-2 in bf16/FP8).")
    ] = None,
    out: Annotated[str, typer.Option(help="Folder for compile_check.json.",
                                         callback=out_folder)] = "bench_results",
) -> None:
    from gem_bench.compile_check import main

    argv = [*recipes, "--out", out, *_overrides(set_)]
    argv += ["--tolerance", str(tolerance)] if tolerance is not None else []
    raise typer.Exit(main(argv))


def _quality(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML.")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override a recipe field (repeatable).")] = None,
    arms: Annotated[str, typer.Option(
        help="Comma-separated arms (as bench e2e's): ours, off_the_shelf, "
             "off_the_shelf_compiled by default.")] = "ours,off_the_shelf,off_the_shelf_compiled",
    target_ne: Annotated[float | None, typer.Option(
        help="Held-out CTR NE to reach (default: the worst of the arms' best).")] = None,
    evals: Annotated[int, typer.Option(help="Held-out evaluations per arm.")] = 10,
    same_process: Annotated[bool, typer.Option(
        help="Train every arm in this process (default: each in a fresh one).")] = False,
    out: Annotated[str, typer.Option(
        help="Folder for the JSON result.", callback=out_folder)] = "bench_results",
    add_to: Annotated[str | None, typer.Option(
        help="An earlier result (quality_*.json) of the same recipe and overrides on this "
             "device: its arms are kept beside these, against one target.")] = None,
) -> None:
    from gem_bench.quality import main

    argv = [recipe, "--arms", arms, "--evals", str(evals), "--out", out, *_overrides(set_)]
    argv += ["--target-ne", str(target_ne)] if target_ne is not None else []
    argv += ["--add-to", add_to] if add_to else []
    argv += ["--same-process"] if same_process else []
    raise typer.Exit(main(argv))


def _quality_targets(
    result: Annotated[str, typer.Argument(help="A quality_*.json that bench quality wrote.")],
    target_ne: Annotated[list[float] | None, typer.Option(
        help="Held-out CTR NE (repeatable; default: the result's target and the worst of "
             "the arms' best).")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON instead of the table.")]
    = False,
) -> None:
    from gem_bench.quality_targets import main

    argv = [result, *[a for t in target_ne or [] for a in ("--target-ne", str(t))]]
    raise typer.Exit(main(argv + (["--json"] if json_ else [])))


def _terms(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML (synthetic data).")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override a recipe field (repeatable).")] = None,
    out: Annotated[str, typer.Option(help="Folder for terms_bench.json.",
                                         callback=out_folder)] = "bench_results",
    max_samples: Annotated[int | None, typer.Option(
        min=1, help="Fit on the held-out split's first shards holding this many samples "
        "(default: the whole split; a large one takes minutes to score).")] = None,
    reference: Annotated[bool, typer.Option(
        "--reference", help="Also train the dataset's linear reference and fit its held-out "
        "CTR logit on the same terms: which signals it reads better than the model.")] = False,
) -> None:
    from gem_bench.terms import main

    argv = [recipe, "--out", out, *_overrides(set_)]
    argv += ["--max-samples", str(max_samples)] if max_samples is not None else []
    argv += ["--reference"] if reference else []
    raise typer.Exit(main(argv))


def _looks(
    results: Annotated[str, typer.Argument(help="A sweep results file (or gemctl compare "
                                                "--json output).")],
    arm: Annotated[str, typer.Option(help="The gated arm.")],
    looks: Annotated[str | None, typer.Option(
        help="Comma-separated seed counts at which the gate was read before (default: the "
             "paired counts after each call the file records; its own count is the last "
             "look).")] = None,
    metric: Annotated[str, typer.Option(help="The NE metric gated.")] = "ne_ctr",
    baseline: Annotated[str | None, typer.Option(
        help="Baseline arm (default: the file's).")] = None,
    max_regression: Annotated[str, typer.Option(
        help="The gate's limit, in % of the baseline's NE.")] = "0.2%",
    out: Annotated[str, typer.Option(help="Folder for looks_bench.json.",
                                         callback=out_folder)] = "bench_results",
) -> None:
    from gem_bench.looks import main

    argv = [results, "--arm", arm, "--metric", metric, "--max-regression", max_regression,
            "--out", out]
    argv += (["--baseline", baseline] if baseline else []) + (["--looks", looks] if looks
                                                              is not None else [])
    raise typer.Exit(main(argv))


def _probe_init(value: str) -> str:
    if value not in ("unit", "normal"):
        raise typer.BadParameter(f"{value[:50]!r}: pass unit or normal.")
    return value


def _probe_readers(value: str) -> str:
    from gem_bench.recall_probe import READERS

    names = [r.strip() for r in value.split(",") if r.strip()]
    if not names or set(names) - set(READERS):
        raise typer.BadParameter(f"{value[:100]!r}: pass a comma-separated list of "
                                 f"{', '.join(READERS)}.")
    return value


def _probe_seeds(value: str) -> str:
    parts = [v.strip() for v in value.split(",")]
    if not parts or not all(v.isdigit() and len(v) < 10 for v in parts):
        raise typer.BadParameter(f"{value[:100]!r}: pass comma-separated seeds, e.g. 0,1,2.")
    return ",".join(parts)


def _recall_probe(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML whose data is world recall.")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override a recipe field (repeatable).")] = None,
    readers: Annotated[str, typer.Option(
        help="Comma-separated: bare, tower, tower_prenorm, tower_attention, model, "
        "model_read.",
        callback=_probe_readers)] = "bare,tower",
    steps: Annotated[int, typer.Option(min=1, help="Training steps per reader.")] = 1500,
    every: Annotated[int, typer.Option(min=1, help="Evaluate every this many steps.")] = 100,
    init: Annotated[str, typer.Option(help="Category rows: unit (norm ~1, as the model's "
                                           "tables) or normal (N(0, 1)).",
                                      callback=_probe_init)] = "unit",
    seeds: Annotated[str, typer.Option(
        help="Comma-separated seeds (initialization and batch order), a curve each: when a "
        "reader starts to learn varies from seed to seed.", callback=_probe_seeds)] = "0",
    reached: Annotated[float, typer.Option(
        min=0.5, max=1.0, help="Report each curve's first step at this held-out AUC.")] = 0.75,
    out: Annotated[str, typer.Option(help="Folder for recall_probe.json.",
                                         callback=out_folder)] = "bench_results",
) -> None:
    from gem_bench.recall_probe import main

    argv = [recipe, "--readers", readers, "--steps", str(steps), "--every", str(every),
            "--init", init, "--seeds", *seeds.split(","), "--reached", str(reached),
            "--out", out, *_overrides(set_)]
    raise typer.Exit(main(argv))


# The commands that take recipes: (function, help, examples).
RECIPE_COMMANDS = {
    "e2e": (_e2e, "A recipe trained by the platform's own build and by the same model from "
            "off-the-shelf parts, same run: samples/s, E2E MFU, peak memory, time by kind of "
            "kernel.", ("gemctl bench e2e recipes/h200_gem.yaml --set model.attention=block64",
                        "gemctl bench e2e --arms ours,ours_dense_tables,ours_fp8_saved")),
    "quality": (_quality, "Time to a target held-out NE, ours against the builds a user "
                "would run instead, same data, same run: each arm's learning curve, final NE "
                "and AUC, samples/s, and training seconds and samples to the target.",
                ("gemctl bench quality recipes/h200_gem.yaml --out docs/quality",
                 "gemctl bench quality recipes/demo.yaml --arms ours,off_the_shelf "
                 "--target-ne 0.9")),
    "repro": (_repro, "What train.deterministic costs and whether it holds: each recipe "
              "trained plain and twice deterministic, each run in a fresh process; samples/s, "
              "the cost, bitwise agreement.",
              ("gemctl bench repro recipes/h200.yaml --set train.steps=50",
               "gemctl bench repro recipes/h200.yaml --grads-only --in-one-process")),
    "terms": (_terms, "Which planted signals a model learned: trains a synthetic-data recipe "
              "in this process, then fits its held-out CTR logit on the planted terms "
              "(coefficient ~1: learned at the planted scale; ~0: missed).",
              ("gemctl bench terms recipes/demo.yaml --set loader.local_batch_size=512 "
               "--reference",
               "gemctl bench terms recipes/demo.yaml --set model.item_vectors=planted")),
    "recall-probe": (_recall_probe, "Can an attention reader learn the recall world's term "
                     "at all: a bare attention, the model's sequence tower or the whole model "
                     "trained on the term's sign itself; held-out AUC every N steps, a curve "
                     "per seed.",
                     ("gemctl bench recall-probe recipes/demo.yaml --set "
                      "data.synthetic.world=recall --set data.synthetic.seq_len.min=88 --set "
                      "data.path=gem_data/recall --steps 1500 --seeds 0,1,2",)),
    "compile-check": (_compile_check, "Step-1 gradients of the compiled model against the "
                      "eager one, per parameter (relative L2 error): does compiling change "
                      "what the model computes? Exit 1 beyond the tolerance.",
                      ("gemctl bench compile-check recipes/h200.yaml",
                       "gemctl bench compile-check recipes/h200.yaml --set precision.mode=fp32")),
}


def register(app: typer.Typer) -> None:
    bench = typer.Typer(no_args_is_help=True, help="Benchmarks: a table plus JSON per run.",
                        context_settings={"help_option_names": ["-h", "--help"]})
    for name, (module, help_text) in BENCHES.items():
        bench.command(name, help=help_text, epilog=epilog(
            f"gemctl bench {name} --out bench_results --quick"))(user_errors(_command(module)))
    for name, (function, help_text, examples) in RECIPE_COMMANDS.items():
        bench.command(name, help=help_text, epilog=epilog(*examples))(user_errors(function))
    bench.command("quality-targets", help="A bench quality result read at several target "
                  "NEs, no training: each arm's seconds and samples to each, and the run length "
                  "beyond which ours is ahead.", epilog=epilog(
                      "gemctl bench quality-targets docs/quality/quality_h200_gem.json",
                      "gemctl bench quality-targets RESULT.json --target-ne 0.9 "
                      "--target-ne 0.88"))(user_errors(_quality_targets))
    bench.command("looks", help="A gate read at several seed counts, no training: how "
                  "often such looks pass a regression at the limit at 95% each, and the "
                  "verdict at the one level for all looks that holds that to 2.5%.",
                  epilog=epilog("gemctl bench looks docs/quality/ablation_precision_h200.json "
                                "--arm fp8_b32 --looks 5,8,20,23,30,35,37,40"))(
        user_errors(_looks))
    bench.command("kernels", help=bench_kernels.HELP, epilog=epilog(*bench_kernels.EXAMPLES))(
        user_errors(bench_kernels.kernels))
    app.add_typer(bench, name="bench")
