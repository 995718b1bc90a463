"""The kernel-speed guard's committed figures and its verdicts: which key shapes it times,
the file of committed milliseconds they are compared with, and the rule that says when a
measurement is a regression. No torch here: this part runs and is tested on any machine."""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from gem_platform.errors import GemError

DIRECTIONS = ("fwd", "fwd+bwd")
FIGURES_PATH = "docs/bench/kernel_guard.json"


@dataclass(frozen=True)
class KeyShape:
    """One kernel at one shape, as a bench module names it: the guard times ``variant`` of
    ``case`` the way that module's rows were timed, so the committed row is comparable."""

    name: str
    bench: str  # the gem_bench module whose case this is
    case: str
    variant: str
    source: str  # the committed JSON of that module's rows


SHAPES: dict[str, KeyShape] = {s.name: s for s in (
    KeyShape("jagged_self", "gem_bench.kernels.jfa", "lognormal_B256_max2048_H4", "ours",
             "docs/bench/jfa.json"),
    KeyShape("gdpa_self", "gem_bench.kernels.gdpa", "self", "ours", "docs/bench/gdpa_self.json"),
    KeyShape("gdpa_cross", "gem_bench.kernels.gdpa", "cross", "ours", "docs/bench/gdpa.json"),
    KeyShape("gdpa_pooled", "gem_bench.kernels.gdpa", "pooled", "ours", "docs/bench/gdpa.json"),
    KeyShape("block64_rope", "gem_bench.kernels.block_attention", "fixed_B16_L4096_H4", "ours",
             "docs/bench/block_attention.json"),
    KeyShape("fp8_linear", "gem_bench.kernels.fp8_linear", "16384x4096->4096", "fp8_b128",
             "docs/bench/fp8_linear.json"),
)}


def keys(names: list[str] | None = None) -> list[str]:
    """'shape/direction' for every direction of the named shapes (all when None)."""
    chosen = list(SHAPES) if names is None else names
    unknown = [n for n in chosen if n not in SHAPES]
    if unknown:
        raise GemError(f"Unknown kernel key shape(s): {', '.join(unknown)}.",
                       f"Choose from: {', '.join(SHAPES)} (comma-separated).")
    return [f"{n}/{d}" for n in chosen for d in DIRECTIONS]


@dataclass
class Figure:
    """A committed time: the ms, the commit it was measured at and where it was read from."""

    ms: float
    commit: str | None
    source: str
    device: str | None = None


@dataclass
class Verdict:
    key: str
    committed_ms: float | None
    measured_ms: float | None
    ratio: float | None  # measured / committed: above 1 is slower
    verdict: str
    failed: bool


def parse_slowdown(text: str) -> float:
    """'10%', '10' or '0.1' -> 0.10: the largest slowdown allowed, as a fraction."""
    raw = text.strip()
    try:
        value = float(raw.rstrip("%"))
    except ValueError:
        value = float("nan")
    if raw.endswith("%") or value >= 1:
        value /= 100
    if not math.isfinite(value) or value < 0:
        raise GemError(f"--max-slowdown {text!r} is not a percentage.",
                       "Pass a non-negative percentage such as 10% (or a fraction such as 0.1).")
    return value


def compare(measured: dict[str, float | None], figures: dict[str, Figure],
            max_slowdown: float) -> list[Verdict]:
    """One verdict per measured key: a time more than ``max_slowdown`` above its committed
    figure fails, and so does a missing or non-finite measurement; a key without a committed
    figure is reported ('no baseline yet') and does not fail."""
    out = []
    for key, ms in measured.items():
        fig = figures.get(key)
        committed = fig.ms if fig else None
        if ms is None or not math.isfinite(ms) or ms <= 0:
            out.append(Verdict(key, committed, None, None, "not measured", True))
            continue
        if fig is None:
            out.append(Verdict(key, None, ms, None, "no baseline yet", False))
            continue
        ratio = ms / committed
        slower = ratio > 1 + max_slowdown
        text = f"slower by {(ratio - 1) * 100:.0f}%" if slower else "ok"
        out.append(Verdict(key, committed, ms, ratio, text, slower))
    return out


def load_figures(path: str | Path) -> dict[str, Figure]:
    """The committed figures, keyed 'shape/direction'; a missing file is no figures."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())["figures"]
        return {k: Figure(**v) for k, v in raw.items()}
    except (ValueError, KeyError, TypeError) as err:
        raise GemError(f"{path} is not a kernel figures file ({type(err).__name__}: {err}).",
                       "Restore it from git, or rewrite it with `gemctl bench kernels "
                       "--update` on the H200.") from None


def save_figures(path: str | Path, figures: dict[str, Figure]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"about": "Committed kernel times (ms, median of triton.testing.do_bench) that "
                        "`gemctl bench kernels --check` compares with; written by --update.",
               "figures": {k: asdict(figures[k]) for k in sorted(figures)}}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def updated(figures: dict[str, Figure], measured: dict[str, float | None], commit: str | None,
            device: str, source: str) -> dict[str, Figure]:
    """The figures with every finite measurement of this run in place of the committed one."""
    out = dict(figures)
    for key, ms in measured.items():
        if ms is not None and math.isfinite(ms) and ms > 0:
            out[key] = Figure(ms, commit, source, device)
    return out


def row_ms(source: Path, shape: KeyShape, direction: str) -> float | None:
    """The ms of the shape's row in a committed bench JSON, None where it has no such row."""
    rows = json.loads(source.read_text())["rows"]
    for r in rows:
        if (r["case"], r["variant"], r["direction"]) == (shape.case, shape.variant, direction):
            return float(r["ms"])
    return None


def seed_figures(root: Path) -> tuple[dict[str, Figure], list[str]]:
    """Figures read from the committed bench JSON of each shape (the commit that last wrote
    that file), and the keys that no committed file measured."""
    figures, missing = {}, []
    for key in keys():
        name, direction = key.split("/", 1)
        shape = SHAPES[name]
        ms = row_ms(root / shape.source, shape, direction)
        if ms is None:
            missing.append(key)
            continue
        commit = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%H", "--",
                                 shape.source], capture_output=True, text=True).stdout.strip()
        device = json.loads((root / shape.source).read_text()).get("device", {}).get("gpu")
        figures[key] = Figure(ms, commit or None, shape.source, device)
    return figures, missing
