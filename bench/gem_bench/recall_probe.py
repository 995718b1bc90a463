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
  output: where along the tower a match is slow to show.

Category rows start at norm ~1, as the model's tables do (``--init normal``: N(0, 1) rows).

    gemctl bench recall-probe recipes/demo.yaml --set data.synthetic.world=recall \\
        --set data.synthetic.num_clusters=100 --set data.synthetic.seq_len.mean=104 \\
        --set data.synthetic.seq_len.min=88 --set data.synthetic.seq_len.max=136 \\
        --set data.path=gem_data/recall --readers bare,tower --steps 1500
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from gem_platform.data.batch import JaggedBatch
from gem_platform.data.ceilings import auc
from gem_platform.data.parquet import SampleTable
from gem_platform.data.prepare import prepare_dataset
from gem_platform.data.worlds import recall_sign
from gem_platform.errors import DataError
from gem_platform.model.attention import SelfAttentionSpec
from gem_platform.model.gem import unit_norm_init
from gem_platform.model.sequence import SequenceTower
from gem_platform.recipe import Recipe, load_recipe

# reader -> what the probe's MLP reads (TowerReader.read for the tower's)
READERS = {"bare": None, "tower": "output", "tower_prenorm": "prenorm",
           "tower_attention": "attention"}


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


def signs(batch: JaggedBatch) -> torch.Tensor:
    """1 where the newest event's category recurs 65 or more events back, else 0."""
    sign = recall_sign(batch.seq_offsets.numpy(), batch.seq_item_categories.numpy())
    return torch.as_tensor(sign > 0, dtype=torch.float32)


def curve(recipe: Recipe, train: SampleTable, held: SampleTable, reader: str, steps: int,
          every: int, batch_size: int, init: str, echo) -> list[dict[str, float]]:
    """Held-out AUC of the sign every ``every`` steps, for one reader trained from seed 0 on
    ``train`` and scored on (the first 3,000 samples of) ``held``."""
    torch.manual_seed(0)
    d = recipe.model.d_model
    module = (BareReader(d, recipe.model.num_heads) if reader == "bare" else
              TowerReader(recipe, READERS[reader]))
    probe = Probe(module, train.meta.num_categories, d, init)
    opt = torch.optim.Adam(probe.parameters(), lr=3e-3)
    held_batch = held.collate(np.arange(min(len(held), 3000)))
    held_sign = signs(held_batch).numpy() > 0
    rng, points, t0 = np.random.default_rng(0), [], time.perf_counter()
    for step in range(1, steps + 1):
        batch = train.collate(rng.integers(0, len(train), batch_size))
        loss = nn.functional.binary_cross_entropy_with_logits(probe(batch), signs(batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss = loss.detach()
        if step % every == 0 or step == steps:
            with torch.no_grad():
                scores = probe(held_batch).numpy()
            points.append({"step": step, "loss": float(loss), "auc": auc(scores, held_sign),
                           "seconds": time.perf_counter() - t0})
            echo(f"{reader} step {step}: loss {float(loss):.4f}, held-out AUC of the sign "
                 f"{points[-1]['auc']:.4f}")
    return points


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[])
    p.add_argument("--readers", default="bare,tower")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--init", choices=("unit", "normal"), default="unit")
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
    train, held = (SampleTable.load(recipe.data.path, split) for split in ("train", "eval"))
    result = {reader: curve(recipe, train, held, reader, args.steps, args.every,
                            args.batch_size, args.init, console.print) for reader in readers}
    table = Table(title="recall probe: held-out AUC of the recall sign (clean labels)")
    table.add_column("step", justify="right")
    for reader in readers:
        table.add_column(reader, justify="right")
    for i, point in enumerate(result[readers[0]]):
        table.add_row(str(point["step"]), *(f"{result[r][i]['auc']:.4f}" for r in readers))
    console.print(table)
    out = Path(args.out) / "recall_probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"recipe": args.recipe, "overrides": args.overrides,
                               "init": args.init, "batch_size": args.batch_size,
                               "curves": result}, indent=1))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
