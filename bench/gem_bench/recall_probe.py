"""gemctl bench recall-probe: can an attention reader learn the recall world's term at all?

The recall world (docs/synthetic-data.md) plants a CTR term that says whether the newest
history event's category occurs 65 or more events back. A model must learn to let the newest
token find an event of its own category. This trains only that: a reader on the history's
category embeddings, against the term's sign itself (clean labels, no clicks), and reports
the held-out AUC of the sign every ``--every`` steps. So it separates "the data's signal is
too weak in clicks" from "this attention block is slow to learn a content match":

- ``bare``: one softmax attention from the newest token over all tokens (LayerNorm'd
  embeddings), read by an MLP beside the newest token's own embedding;
- ``tower``: the model's own SequenceTower (the recipe's layers, heads, QK-norm and attention
  kind), read by the same MLP from the newest token's output; ``tower_prenorm`` reads it
  before the tower's final LayerNorm, ``tower_attention`` reads the last block's attention
  output: where along the tower a match is slow to show;
- ``model``: the recipe's whole GemModel (item, category, action, recency and affinity in
  every history token; tower, cross and pooled attention, DHEN), its CTR logit trained on the
  sign; ``model_read`` the same with ``model.newest_attention`` on (the last layer's attention
  read of the newest event as a DHEN token): whether the model as built can learn the term.

Category rows start at norm ~1, as the model's tables do (``--init normal``: N(0, 1) rows).
When a reader starts to learn the match varies a lot with the seed (initialization and batch
order), so ``--seeds`` trains a curve per seed and the summary gives each curve's first step
at ``--reached`` AUC; read several seeds, never one curve.

    gemctl bench recall-probe recipes/demo.yaml --set data.synthetic.world=recall \\
        --set data.synthetic.num_clusters=100 --set data.synthetic.seq_len.mean=104 \\
        --set data.synthetic.seq_len.min=88 --set data.synthetic.seq_len.max=136 \\
        --set data.path=gem_data/recall --readers bare,tower --steps 1500 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from gem_platform.data.batch import JaggedBatch
from gem_platform.data.ceilings import auc
from gem_platform.data.meta import DatasetMeta
from gem_platform.data.parquet import SampleTable
from gem_platform.data.prepare import prepare_dataset
from gem_platform.data.worlds import recall_sign
from gem_platform.errors import DataError
from gem_platform.model.attention import SelfAttentionSpec
from gem_platform.model.gem import GemModel, unit_norm_init
from gem_platform.model.sequence import SequenceTower
from gem_platform.recipe import Recipe, load_recipe

# reader -> what the probe's MLP reads (TowerReader.read for the tower's)
# the tower readers -> what of the tower the MLP reads (TowerReader.read)
TOWER_READS = {"tower": "output", "tower_prenorm": "prenorm", "tower_attention": "attention"}
READERS = ("bare", *TOWER_READS, "model", "model_read")


class BareReader(nn.Module):
    """One softmax attention from the newest token over its whole history."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = offsets[1:] - offsets[:-1]
        b, d, longest = lengths.numel(), x.shape[1], int(lengths.max())
        x = self.norm(x)
        owner = torch.repeat_interleave(torch.arange(b), lengths)
        padded = x.new_zeros(b, longest, d)
        padded[owner, torch.arange(x.shape[0]) - offsets[:-1][owner]] = x
        newest, dh = x[offsets[1:] - 1], d // self.heads
        q = self.q(newest).view(b, self.heads, dh)
        k, v = (f(padded).view(b, longest, self.heads, dh) for f in (self.k, self.v))
        scores = torch.einsum("bhd,blhd->bhl", q, k) * dh ** -0.5
        scores = scores.masked_fill((torch.arange(longest)[None] >= lengths[:, None])[:, None],
                                    float("-inf"))
        return torch.einsum("bhl,blhd->bhd", scores.softmax(-1), v).reshape(b, d), newest


class TowerReader(nn.Module):
    """The model's sequence tower and the newest token's input. ``read`` says what of the
    tower the MLP gets for the newest token: ``output`` (after the final LayerNorm, what the
    model reads), ``prenorm`` (the last block's output, before that norm) or ``attention``
    (the last block's attention output, its ``out`` projection, before the residual add)."""

    def __init__(self, recipe: Recipe, read: str = "output") -> None:
        super().__init__()
        m = recipe.model
        spec = SelfAttentionSpec(kind=m.attention, window=m.window, causal=m.causal,
                                 rope_base=10000.0 if m.rope else None, kernel="pytorch")
        self.tower = SequenceTower(m.d_model, m.num_heads, m.seq_layers, spec, m.qk_norm,
                                   expose_attention=read == "attention")
        self.read = read

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        longest = int((offsets[1:] - offsets[:-1]).max())
        newest = offsets[1:] - 1
        if self.read == "output":
            return self.tower(x, offsets, longest)[newest], x[newest]
        if self.read == "attention":
            return self.tower.forward_with_attention(x, offsets, longest)[1][newest], x[newest]
        y = x
        for block in self.tower.blocks:
            y = block(y, offsets, longest)
        return y[newest], x[newest]


class Probe(nn.Module):
    """Category embeddings -> a reader -> an MLP on [what it read, the newest token]."""

    def __init__(self, reader: nn.Module, categories: int, d: int, init: str) -> None:
        super().__init__()
        self.embed, self.reader = nn.Embedding(categories, d), reader
        if init == "unit":
            bound = unit_norm_init(d)["weight_init_max"]
            nn.init.uniform_(self.embed.weight, -bound, bound)
        self.head = nn.Sequential(nn.Linear(2 * d, 64), nn.SiLU(), nn.Linear(64, 1))

    def forward(self, batch: JaggedBatch) -> torch.Tensor:
        read, newest = self.reader(self.embed(batch.seq_item_categories), batch.seq_offsets)
        return self.head(torch.cat([read, newest], 1))[:, 0]


class ModelProbe(nn.Module):
    """The recipe's GemModel (PyTorch kernels) whose CTR logit is trained on the sign;
    ``read`` sets model.newest_attention."""

    def __init__(self, recipe: Recipe, meta: DatasetMeta, read: bool) -> None:
        super().__init__()
        cfg = recipe.model.model_copy(update={"newest_attention": read, "kernel": "pytorch"})
        self.model = GemModel(cfg, meta)

    def forward(self, batch: JaggedBatch) -> torch.Tensor:
        return self.model(batch)[:, 0]


def probe_for(recipe: Recipe, meta: DatasetMeta, reader: str, init: str) -> nn.Module:
    """A fresh probe of ``reader`` (seed it first)."""
    if reader.startswith("model"):
        return ModelProbe(recipe, meta, read=reader == "model_read")
    d = recipe.model.d_model
    module = (BareReader(d, recipe.model.num_heads) if reader == "bare" else
              TowerReader(recipe, TOWER_READS[reader]))
    return Probe(module, meta.num_categories, d, init)


def signs(batch: JaggedBatch) -> torch.Tensor:
    """1 where the newest event's category recurs 65 or more events back, else 0."""
    sign = recall_sign(batch.seq_offsets.numpy(), batch.seq_item_categories.numpy())
    return torch.as_tensor(sign > 0, dtype=torch.float32)


def epochs_of(n: int, batch_size: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Batches of sample indices without end: each epoch a fresh permutation, so no sample is
    seen twice before all have been seen once (a model with per-id rows could otherwise
    lower its training loss by recalling repeats, which says nothing about the sign)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(n)
        for start in range(0, max(n - batch_size, 0) + 1, batch_size):  # n < size: all n
            yield order[start:start + batch_size]


@dataclass(frozen=True)
class ProbeRun:
    """One probe training: which reader, its seed (initialization and batch order), and its
    schedule."""

    reader: str
    seed: int
    steps: int
    every: int
    batch_size: int
    init: str


@dataclass(frozen=True)
class HeldOut:
    """What every curve is scored on: the first 3,000 held-out samples and their signs."""

    batch: JaggedBatch
    recurs: np.ndarray  # bool, the sign

    @classmethod
    def of(cls, held: SampleTable) -> HeldOut:
        batch = held.collate(np.arange(min(len(held), 3000)))
        return cls(batch, signs(batch).numpy() > 0)


def curve(recipe: Recipe, train: SampleTable, held: HeldOut, run: ProbeRun,
          echo: Callable[[str], None]) -> list[dict[str, float]]:
    """Held-out AUC of the sign every ``run.every`` steps, for one reader trained on
    ``train``."""
    reader, steps, every = run.reader, run.steps, run.every
    torch.manual_seed(run.seed)
    probe = probe_for(recipe, train.meta, reader, run.init)
    opt = torch.optim.Adam(probe.parameters(), lr=3e-3)
    order = epochs_of(len(train), run.batch_size, run.seed)
    points, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        batch = train.collate(next(order))
        loss = nn.functional.binary_cross_entropy_with_logits(probe(batch), signs(batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss = loss.detach()
        if step % every == 0 or step == steps:
            with torch.no_grad():
                scores = probe(held.batch).numpy()
            points.append({"step": step, "loss": float(loss), "auc": auc(scores, held.recurs),
                           "seconds": time.perf_counter() - t0})
            echo(f"{reader} seed {run.seed} step {step}: loss {float(loss):.4f}, held-out AUC "
                 f"of the sign {points[-1]['auc']:.4f}")
    return points


Curves = dict[str, dict[str, list[dict[str, float]]]]  # reader -> seed -> points


def first_step(points: list[dict[str, float]], reached: float) -> int | None:
    """The first evaluated step whose held-out AUC is at least ``reached`` (None: never)."""
    return next((int(p["step"]) for p in points if p["auc"] >= reached), None)


def curves_table(result: Curves) -> Table:
    """Held-out AUC per evaluated step, a column per reader and seed."""
    table = Table(title="recall probe: held-out AUC of the recall sign (clean labels)")
    table.add_column("step", justify="right")
    columns = [(r, s) for r, by in result.items() for s in by]
    for r, s in columns:
        table.add_column(f"{r} s{s}", justify="right")
    first = result[columns[0][0]][columns[0][1]]
    for i, point in enumerate(first):
        table.add_row(str(point["step"]), *(f"{result[r][s][i]['auc']:.4f}" for r, s in columns))
    return table


def start_table(result: Curves, reached: float) -> Table:
    """Per reader: the first step each seed reached ``reached``. When a reader starts to
    learn the match varies a lot from seed to seed; one seed's curve says little."""
    table = Table(title=f"first evaluated step at held-out AUC >= {reached:g}, per seed")
    table.add_column("reader")
    table.add_column("steps", justify="right")
    for reader, by in result.items():
        steps = [first_step(points, reached) for points in by.values()]
        table.add_row(reader, ", ".join("never" if s is None else str(s) for s in steps))
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[])
    p.add_argument("--readers", default="bare,tower")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--init", choices=("unit", "normal"), default="unit")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--reached", type=float, default=0.75)
    p.add_argument("--out", default="bench_results")
    args = p.parse_args(argv)
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    if not readers or set(readers) - set(READERS):
        raise SystemExit(f"--readers takes a comma-separated list of {', '.join(READERS)}")
    recipe = load_recipe(args.recipe, args.overrides)
    syn = recipe.data.synthetic
    if recipe.data.source != "synthetic" or syn is None or syn.world != "recall":
        raise DataError("The recall probe needs a synthetic dataset of world recall.",
                        "Pass --set data.synthetic.world=recall (and histories of at least "
                        "81 events, e.g. --set data.synthetic.seq_len.min=88) and a data.path "
                        "of its own.")
    prepare_dataset(recipe.data)
    console = Console()
    train = SampleTable.load(recipe.data.path, "train")
    held = HeldOut.of(SampleTable.load(recipe.data.path, "eval"))
    result = {reader: {str(seed): curve(recipe, train, held, ProbeRun(
        reader, seed, args.steps, args.every, args.batch_size, args.init), console.print)
        for seed in args.seeds} for reader in readers}
    console.print(curves_table(result))
    console.print(start_table(result, args.reached))
    out = Path(args.out) / "recall_probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"format": 2, "recipe": args.recipe, "overrides": args.overrides,
                               "init": args.init, "batch_size": args.batch_size,
                               "seeds": args.seeds, "reached": args.reached,
                               "first_step_reaching": {
                                   r: {s: first_step(c, args.reached) for s, c in by.items()}
                                   for r, by in result.items()},
                               "curves": result}, indent=1))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
