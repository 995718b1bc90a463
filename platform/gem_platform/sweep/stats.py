"""Mean +- std over seeds and the t-interval of a difference: the numbers a reader needs to
tell a real regression from seed noise. Paired over seeds when both arms ran the same seeds
(a seed fixes data order and initialization, so the per-seed difference cancels that seed's
own luck); Welch's interval of two independent means otherwise."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Summary:
    mean: float
    std: float  # sample std (n-1); nan with one seed
    n: int


@dataclass(frozen=True)
class Delta:
    """``value`` = mean(arm) - mean(baseline); [low, high] its interval (nan with a single
    seed: there is no variance to estimate). ``method``: "paired" (over per-seed
    differences) or "welch" (two independent samples)."""

    value: float
    low: float
    high: float
    method: str = "welch"
    # spread of one seed's difference (paired: sd of the per-seed differences; Welch: the
    # root sum of both arms' variances) and the seeds behind it; what a planner of more seeds
    # needs
    sd: float = math.nan
    n: int = 0


def summarize(values: list[float]) -> Summary:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return Summary(math.nan, math.nan, 0)
    std = statistics.stdev(vals) if len(vals) > 1 else math.nan
    return Summary(statistics.fmean(vals), std, len(vals))


def t_quantile(p: float, df: float) -> float:
    """Student t quantile; scipy when present (it ships with MLflow), else the normal one
    corrected by the Cornish-Fisher expansion (within 1% for df >= 3)."""
    try:
        from scipy.stats import t

        return float(t.ppf(p, df))
    except ImportError:
        z = statistics.NormalDist().inv_cdf(p)
        g1 = (z**3 + z) / 4
        g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
        g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
        return z + g1 / df + g2 / df**2 + g3 / df**3


def welch_delta(arm: list[float], base: list[float], confidence: float = 0.95) -> Delta:
    """Difference of means with a Welch (unequal variances) t-interval."""
    a, b = summarize(arm), summarize(base)
    value = a.mean - b.mean
    if a.n < 2 or b.n < 2:
        return Delta(value, math.nan, math.nan, n=min(a.n, b.n))
    va, vb = a.std**2 / a.n, b.std**2 / b.n
    se = math.sqrt(va + vb)
    sd, n = math.sqrt(a.std**2 + b.std**2), min(a.n, b.n)
    if se == 0:
        return Delta(value, value, value, sd=sd, n=n)
    df = (va + vb) ** 2 / (va**2 / (a.n - 1) + vb**2 / (b.n - 1))
    half = t_quantile(0.5 + confidence / 2, df) * se
    return Delta(value, value - half, value + half, sd=sd, n=n)


def paired_delta(arm: list[float], base: list[float], confidence: float = 0.95) -> Delta:
    """Mean of the per-seed differences arm[i] - base[i] with a t-interval over them (n - 1
    degrees of freedom). Pairs with a non-finite side are left out."""
    if len(arm) != len(base):
        raise ValueError(f"paired_delta needs one baseline value per arm value; got "
                         f"{len(arm)} and {len(base)}")
    diffs = [a - b for a, b in zip(arm, base, strict=True)
             if math.isfinite(a) and math.isfinite(b)]
    if not diffs:
        return Delta(math.nan, math.nan, math.nan, "paired")
    value = statistics.fmean(diffs)
    if len(diffs) < 2:
        return Delta(value, math.nan, math.nan, "paired", n=1)
    return at_confidence(Delta(value, math.nan, math.nan, "paired", statistics.stdev(diffs),
                               len(diffs)), confidence)


def at_confidence(delta: Delta, confidence: float) -> Delta:
    """A paired delta with its t-interval at ``confidence``, from its mean, the spread of its
    per-seed differences and their count (in whatever unit ``relative`` left them): the same
    comparison read at another level, as a gate read after several looks needs."""
    if delta.method != "paired" or delta.n < 2 or not math.isfinite(delta.sd):
        raise ValueError("at_confidence needs a paired delta over 2 or more seeds")
    half = t_quantile(0.5 + confidence / 2, delta.n - 1) * delta.sd / math.sqrt(delta.n)
    return replace(delta, low=delta.value - half, high=delta.value + half)


def relative(delta: Delta, base_mean: float) -> Delta:
    """The same delta in percent of the baseline mean."""
    if not base_mean or not math.isfinite(base_mean):
        return replace(delta, value=math.nan, low=math.nan, high=math.nan, sd=math.nan)
    k = 100.0 / abs(base_mean)
    return replace(delta, value=delta.value * k, low=delta.low * k, high=delta.high * k,
                   sd=delta.sd * k)


def seeds_to_settle(mean: float, sd: float, limit: float, confidence: float = 0.95,
                    most: int = 1000) -> int | None:
    """Seeds whose interval (half width t * sd / sqrt(n)) would leave ``limit`` outside it,
    if the mean and the spread stayed as observed. None when that is unknowable (no spread
    measured yet, the mean on the limit) or beyond ``most`` seeds."""
    margin = abs(mean - limit)
    if not (math.isfinite(sd) and math.isfinite(margin)) or margin == 0:
        return None
    for n in range(2, most + 1):
        if t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n) < margin:
            return n
    return None


def seeds_to_settle_closer(mean: float, sd: float, n: int, limit: float) -> int | None:
    """``seeds_to_settle`` had the mean moved one standard error (sd / sqrt(n)) toward
    ``limit``: how far that estimate can run when the mean is within noise of the limit, as
    more seeds move it. None where that step reaches the limit (no count is sure to do) or the
    spread is unknown."""
    if n < 2 or not math.isfinite(sd):
        return None
    step = sd / math.sqrt(n)
    closer = mean + step if mean < limit else mean - step
    if (closer - limit) * (mean - limit) <= 0:
        return None
    return seeds_to_settle(closer, sd, limit)


def mean_sd(mean: float, std: float, digits: int = 4) -> str:
    """'mean±std' ('-' for no mean, the mean alone for no spread): one number of a table."""
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f}" + ("" if math.isnan(std) else f"±{std:.{digits}f}")


def delta_text(d: Delta | None, unit: str, digits: int, sep: str = ", ") -> str:
    """'+value[unit] [low, high]' (the interval where it is finite); '' for no delta."""
    if d is None or math.isnan(d.value):
        return ""
    text = f"{d.value:+.{digits}f}{unit}"
    if math.isfinite(d.low) and math.isfinite(d.high):
        text += f" [{d.low:+.{digits}f}{sep}{d.high:+.{digits}f}]"
    return text
