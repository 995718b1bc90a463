"""Does a graph Inductor loads from a shared on-disk cache, first compiled at a small size, sum
a large batch in another order than the same graph compiled for that size in its own cache?

Three processes run ``silu(x @ w).sum(0)`` compiled with dynamic shapes (a reduction over a
batch's rows, as a bias's gradient is over a batch's tokens): the first compiles it at
``--small`` rows into cache A, the second runs ``--large`` rows with cache A (a cache hit:
the graph is keyed by its symbolic shapes), the third runs ``--large`` rows with a cache of its
own. Bitwise-equal outputs say a shared cache can't move a deterministic run's bits this way;
unequal ones say it can, which is why a deterministic run compiles into its recipe's own cache
(gem_platform/train/compile_cache.py). Prints one line, writes ``compile_cache_probe.json``
under ``--out``.

    PYTHONPATH=kernels:platform:bench:. python -m gem_bench.compile_cache_probe --out DIR
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from gem_platform.fresh_process import call_in_fresh_process
from gem_platform.train.compile_cache import inductor_cache_at

DIM = 256


def _run_once(rows: int, device: str, out: str) -> None:
    """One process's part: compile (or load) the graph, run it at ``rows``, save the output."""
    torch.manual_seed(0)
    w = torch.randn(DIM, DIM, device=device)
    compiled = torch.compile(lambda x: torch.nn.functional.silu(x @ w).sum(0), dynamic=True)
    x = torch.randn(rows, DIM, device=device)
    torch._dynamo.mark_dynamic(x, 0)
    torch.save(compiled(x).cpu(), out)


def _in_process(rows: int, device: str, out: Path, cache: Path) -> None:
    """``_run_once`` in a fresh process whose Inductor cache is ``cache``."""
    with inductor_cache_at(str(cache)):  # the spawned process starts with this environment
        call_in_fresh_process(_run_once, rows, device, str(out))


def measure(device: str, small: int, large: int) -> dict[str, Any]:
    """The probe's three processes; the comparison of the two large outputs."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _in_process(small, device, root / "small.pt", root / "shared")
        _in_process(large, device, root / "from_shared.pt", root / "shared")
        _in_process(large, device, root / "own.pt", root / "own")
        shared, own = torch.load(root / "from_shared.pt"), torch.load(root / "own.pt")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "small_rows": small, "large_rows": large,
            "bitwise_equal": bool(torch.equal(shared, own)),
            "max_abs_difference": float((shared - own).abs().max()),
            "max_abs_value": float(own.abs().max())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", type=int, default=1_000)
    p.add_argument("--large", type=int, default=400_000)
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    result = measure(args.device, args.small, args.large)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile_cache_probe.json").write_text(json.dumps(result, indent=2) + "\n")
    verdict = "equal" if result["bitwise_equal"] else "DIFFERS"
    print(f"{result['device']}: shared cache {verdict} (max |difference| "
          f"{result['max_abs_difference']:.3g} of {result['max_abs_value']:.3g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
