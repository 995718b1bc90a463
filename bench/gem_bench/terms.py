"""gemctl bench terms: which planted signals a trained model's CTR scores follow.

On synthetic data the CTR logit is a sum of planted terms (recent and long-term affinity,
per-id effects, the candidate's category, dense features; per world). This trains a recipe in
this process (one rank, as ``gemctl submit --local``), scores the held-out split and fits the
model's CTR logit by least squares on those terms:

- ``coef``: near 1, the model's logit moves with the term at the planted scale; near 0, the
  model misses it. A model unsure of itself shrinks every coefficient alike.
- ``partial_corr``: the correlation of the model's logit with the term, both with the other
  terms regressed out: the same question without the overall scale.
- ``r2``: how much of the model's logit the planted terms explain (the rest is noise the model
  learned, or structure at another scale).

terms_bench.json also keeps the run's final held-out scores of every task (``eval``) and its
learning curve (``curve``: each evaluation along the way, as the run summary holds it).

Two runs of it tell which signal a change helps: e.g. the learned item tables against
``model.item_vectors=planted`` (docs/quality/README.md). ``--reference`` also trains the
dataset's linear reference (``gemctl data reference``) and fits its held-out CTR logit the
same way, so the table shows which terms the reference reads better than the model.

    gemctl bench terms recipes/demo.yaml --set loader.local_batch_size=512 --reference
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from gem_platform.data.ceilings import auc
from gem_platform.data.learnability import eval_split
from gem_platform.data.parquet import SampleTable
from gem_platform.data.synthetic import PlantedWorld
from gem_platform.errors import DataError, RecipeError
from gem_platform.recipe import Recipe, load_recipe
from gem_platform.train.learning_report import held_out_scores
from gem_platform.train.loop import autocast_for, train

EVAL_BATCH = 1024


@dataclass
class TermCapture:
    """What a model's logit holds of each planted term (see the module docstring)."""

    coef: dict[str, float]
    partial_corr: dict[str, float]
    r2: float
    residual_std: float


def _least_squares(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(coefficients of ``x``'s columns, residual) of ``y``'s fit on them and an intercept."""
    design = np.column_stack([x, np.ones(len(y))])
    beta, *_ = np.linalg.lstsq(design, y, rcond=None)
    return beta[:-1], y - design @ beta


def capture(logits: np.ndarray, terms: dict[str, np.ndarray]) -> TermCapture:
    """Least-squares fit of ``logits`` on the planted ``terms`` (name -> per-sample value)."""
    names = list(terms)
    x = np.column_stack([terms[n] for n in names]).astype(np.float64)
    z = logits.astype(np.float64)
    beta, residual = _least_squares(x, z)
    partial = {}
    for i, name in enumerate(names):
        others = np.delete(x, i, axis=1)
        a, b = _least_squares(others, z)[1], _least_squares(others, x[:, i])[1]
        denom = float(np.linalg.norm(a) * np.linalg.norm(b))
        partial[name] = float(a @ b / denom) if denom else 0.0
    return TermCapture(coef={n: float(beta[i]) for i, n in enumerate(names)},
                       partial_corr=partial, r2=float(1 - residual.var() / z.var()),
                       residual_std=float(residual.std()))


def held_out_terms(recipe: Recipe, max_samples: int | None = None
                   ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The planted CTR terms and labels of the recipe's held-out split (its first shards,
    holding ``max_samples``, when given), in the order the dataset stores it (the generator's
    own draw, repeated)."""
    world = PlantedWorld.build(recipe.data.synthetic)
    parts = eval_split(world, max_samples)
    per_part = [world.terms(a).ctr for a in parts]
    terms = {name: np.concatenate([p[name] for p in per_part]) for name in per_part[0]}
    return terms, np.concatenate([a.ctr for a in parts]).astype(np.float64)


@torch.no_grad()
def held_out_logits(model: torch.nn.Module, recipe: Recipe, rows: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(CTR logits, CTR labels) of the stored held-out split's first ``rows`` samples (all
    when None), in its order."""
    table = SampleTable.load(recipe.data.path, "eval", 0, 1)
    device = next(model.parameters()).device
    model.eval()
    logits, labels = [], []
    end = len(table) if rows is None else min(rows, len(table))
    for start in range(0, end, EVAL_BATCH):
        batch = table.collate(np.arange(start, min(start + EVAL_BATCH, end))).to(device)
        with autocast_for(recipe, device):
            logits.append(model(batch)[:, 0].float().cpu())
        labels.append(batch.labels[:, 0].cpu())
    return torch.cat(logits).numpy(), torch.cat(labels).numpy().astype(np.float64)


def reference_capture(recipe: Recipe, terms: dict[str, np.ndarray],
                      planted_labels: np.ndarray) -> dict:
    """Train the dataset's linear reference (its default settings, as ``gemctl data
    reference``) and fit its held-out CTR logits on ``terms`` (the first rows of the split,
    as many as ``planted_labels``)."""
    from gem_platform.data.shards import load_meta
    from gem_platform.reference.config import LinearReferenceConfig
    from gem_platform.reference.fit import fit

    cfg, path = LinearReferenceConfig(), recipe.data.path
    meta = load_meta(path)
    logits, labels = fit(path, meta, cfg).eval_logits(path, meta, cfg)
    ctr, rows = logits[:len(planted_labels), 0], labels[:len(planted_labels), 0]
    if len(rows) != len(planted_labels) or not np.array_equal(rows, planted_labels):
        raise DataError(f"The reference's held-out split at {path} is not this recipe's "
                        "synthetic draw (its labels differ).",
                        "Regenerate it for this recipe: gemctl data generate RECIPE --force.")
    return {"auc_ctr": auc(ctr, planted_labels), "epochs": cfg.epochs,
            "capture": asdict(capture(ctr, terms))}


def measure(recipe: Recipe, echo: Callable[[object], None] = print,
            max_samples: int | None = None, reference: bool = False) -> dict:
    """Train ``recipe`` here, then fit its held-out CTR logits on the planted terms (of the
    held-out split's first shards holding ``max_samples``, when given: a large split takes
    minutes to score and to draw again); with ``reference``, the linear reference's too."""
    if recipe.data.source != "synthetic":
        raise RecipeError(f"data.source is {recipe.data.source!r}: only a generated "
                          "(synthetic) world has planted terms.",
                          "Run gemctl bench terms on a recipe with data.source: synthetic.")
    held: dict[str, torch.nn.Module] = {}
    summary = train(recipe, echo=echo, on_step=lambda _, m: held.__setitem__("model", m))
    terms, planted_labels = held_out_terms(recipe, max_samples)
    logits, labels = held_out_logits(held["model"], recipe, len(planted_labels))
    if len(planted_labels) != len(labels) or not np.array_equal(planted_labels, labels):
        raise DataError(f"The dataset at {recipe.data.path} is not this recipe's synthetic "
                        "draw (its held-out labels differ).",
                        "Regenerate it for this recipe: gemctl data generate RECIPE --force.")
    total = sum(terms.values())
    result = {"held_out_samples": len(labels),
              "auc_ctr": auc(logits, labels), "planted_auc_ctr": auc(total, labels),
              "term_auc_ctr": {n: auc(t, labels) for n, t in terms.items()},
              "eval/ne_ctr": summary.get("eval/ne_ctr"),
              "capture": asdict(capture(logits, terms)),
              # what the run printed, kept: its final held-out scores per task and its curve
              "eval": held_out_scores(summary),
              "curve": list(summary.get("quality/eval_curve", []))}
    if reference:
        echo("training the linear reference on the same data")
        result["reference"] = reference_capture(recipe, terms, planted_labels)
    return result


def render(result: dict, console: Console) -> None:
    cap, ref = result["capture"], result.get("reference")
    title = (f"held-out CTR: model AUC {result['auc_ctr']:.4f}, planted "
             f"{result['planted_auc_ctr']:.4f}; terms explain {cap['r2']:.0%} of the model's "
             "logit")
    columns = ["planted term", "AUC alone", "coef", "partial corr"]
    if ref:
        title += f"; linear reference AUC {ref['auc_ctr']:.4f}"
        columns += ["ref. coef", "ref. partial"]
    table = Table(title=title)
    table.add_column(columns[0], no_wrap=True)  # the term names stay whole
    for col in columns[1:]:
        table.add_column(col, justify="right")
    for name, coef in cap["coef"].items():
        row = [name, f"{result['term_auc_ctr'][name]:.3f}", f"{coef:.3f}",
               f"{cap['partial_corr'][name]:.3f}"]
        if ref:
            row += [f"{ref['capture']['coef'][name]:.3f}",
                    f"{ref['capture']['partial_corr'][name]:.3f}"]
        table.add_row(*row)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipe", help="recipe YAML (synthetic data)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="recipe override a.b=v (repeatable)")
    p.add_argument("--out", default="bench_results", help="folder for terms_bench.json")
    p.add_argument("--max-samples", type=int, default=None,
                   help="fit on the held-out split's first shards holding this many samples")
    p.add_argument("--reference", action="store_true",
                   help="also train the dataset's linear reference and fit its logits")
    args = p.parse_args(argv)
    if args.max_samples is not None and args.max_samples < 1:
        raise RecipeError(f"--max-samples is {args.max_samples}: it counts held-out samples.",
                          "Give a positive number, or leave it out to fit on the whole split.")
    recipe = load_recipe(args.recipe, ["parallel.workers=1", *args.overrides])
    console = Console(stderr=True)
    result = measure(recipe, echo=lambda event: console.print(str(event), markup=False,
                                                              highlight=False),
                     max_samples=args.max_samples, reference=args.reference)
    result |= {"recipe": args.recipe, "overrides": args.overrides}
    render(result, Console())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "terms_bench.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
