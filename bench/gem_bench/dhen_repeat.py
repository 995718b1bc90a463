"""One DHEN layer at recipes/h200.yaml's shapes, trained three times on the same inputs under
bf16 autocast and deterministic mode (CUDA): does its backward repeat bit for bit, and how far
is its input gradient from the same layer's fp32 eager gradient?

Before each run the caching allocator's free memory is filled with 0, 1, 0, so a kernel that
reads memory it did not write shows. Each run ends with the loop's own treatment of the
gradients: shared gradients separated, then clipped (``parallel.clip``), so a race there shows
too. ``--gram bmm`` builds the dot interaction's Gram with ``torch.bmm`` as before 2590861
(autograd's two-bmm backward), ``self`` (the default) with ``interaction.self_gram``;
``--eager`` skips compiling. Prints one line, writes ``dhen_repeat.json`` under ``--out``.

    PYTHONPATH=kernels:platform:bench:. python -m gem_bench.dhen_repeat --gram bmm --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from gem_platform.model.interaction import DhenLayer, DotInteraction
from gem_platform.parallel.clip import clip_grad_norm
from gem_platform.train.determinism import deterministic_mode
from gem_platform.train.shared_grads import separate_shared_grads

SAMPLES, TOKENS, DIM, EXPERTS, HIDDEN = 1024, 16, 256, 4, 1024
FILLS = (0.0, 1.0, 0.0)


class _BmmGramDot(DotInteraction):
    """The dot interaction as it was: its Gram through ``torch.bmm`` and autograd, its pairs
    by an index."""

    def __init__(self, num_tokens: int, out_dim: int) -> None:
        super().__init__(num_tokens, out_dim)
        rows, cols = torch.triu_indices(num_tokens, num_tokens, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        gram = torch.bmm(tokens, tokens.transpose(1, 2)) * tokens.shape[-1] ** -0.5
        return self.proj(gram[:, self.rows, self.cols])


def fill_free_memory(value: float) -> None:
    """Leave the caching allocator's free blocks (large and small pool) holding ``value``."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    big = torch.full((1 << 29,), value, device="cuda")
    small = [torch.full((1 << 17,), value, device="cuda") for _ in range(500)]
    del big, small
    torch.cuda.synchronize()


def _layer(gram: str) -> DhenLayer:
    layer = DhenLayer(TOKENS, DIM, EXPERTS, HIDDEN)
    if gram == "bmm":
        old = _BmmGramDot(TOKENS, TOKENS * DIM)
        old.load_state_dict(layer.dot.state_dict())
        layer.dot = old
    return layer.cuda()


def measure(gram: str = "self", compiled: bool = True) -> dict[str, Any]:
    """The three runs compared with each other and with fp32 eager (see the module doc)."""
    with deterministic_mode(0, torch.device("cuda")):
        layer = _layer(gram)
        gen = torch.Generator(device="cuda").manual_seed(1)
        x0 = torch.randn(SAMPLES, TOKENS, DIM, device="cuda", generator=gen)
        grad_out = torch.randn(SAMPLES, TOKENS, DIM, device="cuda", generator=gen)
        x = x0.clone().requires_grad_(True)
        layer(x).backward(grad_out)
        reference = x.grad.clone()
        forward = (torch.compile(layer.forward, backend="inductor", dynamic=True)
                   if compiled else layer.forward)
        warm = torch.randn(SAMPLES // 2, TOKENS, DIM, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            forward(warm).sum().backward()
        runs = []
        for value in FILLS:
            fill_free_memory(value)
            layer.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = forward(x)
            out.backward(grad_out)
            separate_shared_grads(layer.parameters())
            clip_grad_norm(list(layer.parameters()), [], None, max_norm=1e-3)
            runs.append({"input": x.grad.clone(),
                         **{n: p.grad.clone() for n, p in layer.named_parameters()}})
    first = runs[0]
    differing = sorted({n for run in runs[1:] for n in first if not torch.equal(first[n],
                                                                                run[n])})
    return {"gram": gram, "compiled": compiled, "repeats": not differing,
            "differing": differing,
            "relative_error": [float((r["input"] - reference).norm() / reference.norm())
                               for r in runs],
            "max_abs_error": [float((r["input"] - reference).abs().max()) for r in runs],
            "reference_max_abs": float(reference.abs().max())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gram", choices=("self", "bmm"), default="self")
    p.add_argument("--eager", action="store_true", help="do not compile the layer")
    p.add_argument("--out", default="bench_results", help="folder for dhen_repeat.json")
    args = p.parse_args(argv)
    result = measure(args.gram, compiled=not args.eager)
    print(json.dumps(result), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dhen_repeat.json").write_text(json.dumps(result, indent=1))
    return 0 if result["repeats"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
